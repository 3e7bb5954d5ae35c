"""Packed micro-batches: the samples laid end to end give the padded batch's log-probs, entropies and
optimizer step (the per-sample attention that a CPU runs; a GPU's FlashAttention is checked in
tests/test_gpu_learner.py).

Run: pytest tests/test_packing.py
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nano_miles.algo.grpo import assemble_batch, token_scores
from nano_miles.algo.packing import Packing, is_packed
from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer import packed_attention
from nano_miles.stages.trainer.learner import Learner
from test_learner import TEMPERATURE, make_samples


def test_pack_and_unpack_move_exactly_the_real_tokens():
    lengths, width = [3, 1, 4], 5
    p = Packing.of(lengths, width)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.max_length == 4 and p.num_tokens == 8
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    padded = torch.arange(3 * width * 2).reshape(3, width, 2)
    real = torch.zeros(3, width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        real[row, :n] = True
    packed = p.pack(padded)
    assert packed.shape == (1, 8, 2) and torch.equal(packed[0], padded[real])
    assert torch.equal(p.unpack(packed, (3, width)), torch.where(real[..., None], padded, 0))


def test_a_batch_packs_its_attended_tokens(policy_dir):
    samples = make_samples(6)
    batch = assemble_batch([s.prompt for s in samples], [s.response for s in samples],
                           [s.logprobs for s in samples], [0.0] * 6, pad_id=0)
    assert batch.packing.num_tokens == int(batch.attention_mask.sum())
    assert torch.equal(batch.packing.pack(batch.attention_mask), torch.ones(1, batch.packing.num_tokens,
                                                                             dtype=torch.int64))
    assert batch.num_tokens == int(batch.loss_mask.sum()) == sum(len(s.response) for s in samples)


def packed_twin(model):
    twin = copy.deepcopy(model)
    assert packed_attention.enable(twin) and is_packed(twin) and not is_packed(model)
    return twin


def test_packed_scores_equal_the_padded_batch(policy_dir):
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    twin = packed_twin(model)
    samples = make_samples(9)
    b = assemble_batch([s.prompt for s in samples], [s.response for s in samples], [s.logprobs for s in samples],
                       [0.0] * 9, pad_id=0)
    padded, padded_entropy = token_scores(model, b.input_ids, b.targets, b.attention_mask, TEMPERATURE,
                                          positions=b.loss_mask, with_entropy=True)
    packed, packed_entropy = token_scores(twin, b.input_ids, b.targets, b.attention_mask, TEMPERATURE,
                                          positions=b.loss_mask, with_entropy=True, packing=b.packing)
    assert padded.abs().sum() > 0
    assert torch.allclose(packed, padded, atol=1e-5) and torch.allclose(packed_entropy, padded_entropy, atol=1e-5)
    # a packed model still scores a padded batch (no packing given) as the padded model does
    again = token_scores(twin, b.input_ids, b.targets, b.attention_mask, TEMPERATURE, positions=b.loss_mask)[0]
    assert torch.allclose(again, padded, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_packed_step_is_the_padded_step(policy_dir, checkpointing):
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    twin = packed_twin(model)
    samples = make_samples(12)
    results = {}
    for name, m in (("padded", model), ("packed", twin)):
        learner = Learner(TrainerConfig(micro_batch_tokens=200, lr=1e-3, gradient_checkpointing=checkpointing), m,
                          pad_id=0, temperature=TEMPERATURE, max_new_tokens=40)
        results[name] = learner.step(samples)[0]
    assert results["packed"].num_micro_batches == results["padded"].num_micro_batches > 1
    assert abs(results["packed"].pg_loss - results["padded"].pg_loss) < 1e-6
    assert results["packed"].num_tokens == results["padded"].num_tokens
    # the gradients the optimizer stepped on (Adam's m / sqrt(v) would blow a rounding-level gap in a
    # near-zero gradient up to a full learning-rate step, so the weights are no finer a test)
    scale = max(float(p.grad.abs().max()) for p in model.parameters())
    assert scale > 0
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * scale, name


def test_models_that_attend_otherwise_stay_padded():
    sliding = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                           use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert not packed_attention.can_pack(sliding) and not packed_attention.enable(sliding)
    assert not packed_attention.can_pack(torch.nn.Linear(2, 2))
    assert packed_attention.can_pack(Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50)))


def test_scores_by_host_indices_are_the_boolean_masks_bit_for_bit(policy_dir):
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    samples = make_samples(7)
    b = assemble_batch([s.prompt for s in samples], [s.response for s in samples], [s.logprobs for s in samples],
                       [0.0] * 7, pad_id=0)
    assert torch.equal(b.loss_index, b.loss_mask.flatten().nonzero().squeeze(1))
    for entropy_grad in (False, True):
        by_mask = token_scores(model, b.input_ids, b.targets, b.attention_mask, TEMPERATURE, positions=b.loss_mask,
                               with_entropy=True, entropy_grad=entropy_grad)
        by_index = token_scores(model, b.input_ids, b.targets, b.attention_mask, TEMPERATURE, positions=b.loss_mask,
                                with_entropy=True, entropy_grad=entropy_grad, index=b.loss_index)
        assert torch.equal(by_mask[0], by_index[0]) and torch.equal(by_mask[1], by_index[1])
