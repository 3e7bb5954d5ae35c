"""The project's own small starting policy: a tiny Qwen2 causal LM warmed up on the arithmetic task.
Run: python -m nano_miles.policy build --out DIR [--seed N] [--shape medium --device cuda]
     python -m nano_miles.policy sweep --out DIR --shape medium --device cuda --num-steps N --eval-every K
     python -m nano_miles.policy eval --model DIR

There is no model hub here, so the policy is built from scratch: a byte-level tokenizer with a
ChatML chat template (`tokenizer.py`), a Qwen2ForCausalLM with tied embeddings saved as float32
safetensors, and a short supervised warm-up on the train split (`build.py`) in three formats
(`formats.py`: the plain arithmetic prompt of the default run, the same as a chat turn, and word
problems as a chat turn), measured without an engine by `evaluate.py`. Any local HF causal-LM
directory can stand in for this one.
"""
