"""Every message that crosses a process boundary: the project's only shared vocabulary."""
