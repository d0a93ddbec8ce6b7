"""The flattened-token runtime: requests, scheduler, paged KV cache, model runner, sampler, engine."""
