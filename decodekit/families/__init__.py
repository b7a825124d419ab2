"""decodekit's model families: plain nn.Modules with the transformers forward contract (llama.py: Llama 2/3, SmolLM,
Mistral, Qwen2/2.5, Qwen3), their config, rotary tables, the KV caches they read and write and what their forward
returns. They know nothing of generation, batching, loading or transformers; decodekit.facade.Model gives them
generate()."""
