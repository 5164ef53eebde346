"""vLLM as a rollout engine: in-process (`engine.VLLMEngine`) or an HTTP server (`server.VLLMServerEngine`)."""
