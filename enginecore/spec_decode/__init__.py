"""Draft-free speculative decoding in the core: proposers that read a request's own
tokens (n-gram) or a suffix structure over it and recent outputs (suffix), and the
Drafter that decides per request and per step how many drafts to send."""
