"""Model shapes the speed benchmarks build with random weights (speed does not depend on weight values)."""

LLAMA_3_1_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)  # fmt: skip

# A tiny shape for checking the scripts on a CPU in seconds.
TINY = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, vocab_size=1000, rope_theta=500000.0, max_position_embeddings=16384,
)  # fmt: skip
