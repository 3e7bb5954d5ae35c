"""Model shapes the GPU benches build with random weights (nothing is downloaded).

`QWEN25_05B`: the values of Qwen2.5-0.5B-Instruct's config.json that set its tensors' shapes, for
`transformers.Qwen2Config(**QWEN25_05B)`.
"""

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, eos_token_id=151645,
                  bos_token_id=151643)
