"""A worker process per GPU (or CPU), owning no KV-cache policy: it follows the core.

- main: the process loop that speaks the core's protocol (handshake, steps, shutdown).
- model_runner: one step end to end (plan, launch, collect); step_state: what a step
  carries between them; step_hooks: the one point a benchmark instruments.
- kv_cache_memory: the KV budget (a GPU profiles its largest step) and exactly the KV
  cache tensors of the KVCacheConfig it is sent (each layer's K/V are views into the
  buffers that name it).
- input_batch: the persistent batch the SchedulerOutput deltas describe; block_table:
  the block ids (their only home on the worker), slot mapping and the device copy;
  model_inputs: the flat per-step inputs; attention: per-step attention metadata.
- model_config, weights, models/, layers: reading a Hugging Face checkpoint and running it.
- sampler: greedy and random sampling; sampling_extras: penalties, biases, masks and
  bans for the rows that ask; parallel: tensor parallelism across workers.
"""
