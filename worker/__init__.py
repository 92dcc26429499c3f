"""A worker process per GPU (or CPU): the persistent batch (input_batch), block tables and
slot mapping (block_table), flat step inputs (model_inputs), the model and its paged KV
cache (model_runner, models/, layers), the sampler, tensor parallelism (parallel) and the
process loop that speaks the core's protocol (main)."""
