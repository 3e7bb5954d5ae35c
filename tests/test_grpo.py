"""GRPO's data side: TITO alignment, fp32 logprobs."""

import math

import numpy as np
import pytest
import torch

from nano_miles.algo.grpo import assemble_batch, token_logprobs


def test_batch_alignment_shift_by_one():
    prompts = [np.array([5, 6, 7]), np.array([9])]
    responses = [np.array([1, 2]), np.array([3, 4, 8])]
    logprobs = [np.array([-0.1, -0.2]), np.array([-0.3, -0.4, -0.5])]
    b = assemble_batch(prompts, responses, logprobs, [2.0, -1.0], pad_id=0)
    assert b.input_ids.shape == b.targets.shape == (2, 4)  # T = max(3+2, 1+3) = 5 -> 4 positions
    assert b.input_ids[0].tolist() == [5, 6, 7, 1] and b.targets[0].tolist() == [6, 7, 1, 2]
    assert b.input_ids[1].tolist() == [9, 3, 4, 8] and b.targets[1].tolist() == [3, 4, 8, 0]
    # response occupies prediction positions [P-1, P+R-1): exactly R of them, targets == response
    assert b.loss_mask[0].tolist() == [False, False, True, True]
    assert b.loss_mask[1].tolist() == [True, True, True, False]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert b.targets[i][b.loss_mask[i]].tolist() == r.tolist()
    assert b.advantages[0].tolist() == [0, 0, 2, 2] and b.advantages[1].tolist() == [-1, -1, -1, 0]
    assert torch.allclose(b.old_logprobs[0], torch.tensor([0, 0, -0.1, -0.2]))
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert b.num_tokens == 5


def test_batch_with_padding_inside_keeps_every_row_aligned(policy_dir):
    pad = 250  # a pad id no sample uses, so every padded position is visible
    prompts = [np.array([11, 12]), np.array([31, 32, 33, 34]), np.array([51])]
    responses = [np.array([21, 22, 23, 24, 25]), np.array([41]), np.array([61, 62])]
    logprobs = [np.array([-0.1, -0.2, -0.3, -0.4, -0.5]), np.array([-0.6]), np.array([-0.7, -0.8])]
    b = assemble_batch(prompts, responses, logprobs, [0.5, -1.5, 2.0], pad_id=pad)
    # T = 7 (the longest sample), 6 prediction positions; the shorter rows are right-padded
    assert b.input_ids.tolist() == [[11, 12, 21, 22, 23, 24], [31, 32, 33, 34, 41, pad],
                                    [51, 61, 62, pad, pad, pad]]
    assert b.targets.tolist() == [[12, 21, 22, 23, 24, 25], [32, 33, 34, 41, pad, pad],
                                  [61, 62, pad, pad, pad, pad]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[False, True, True, True, True, True],
                                    [False, False, False, True, False, False],
                                    [True, True, False, False, False, False]]
    assert b.advantages.tolist() == [[0, 0.5, 0.5, 0.5, 0.5, 0.5], [0, 0, 0, -1.5, 0, 0], [2, 2, 0, 0, 0, 0]]
    f = np.float32
    assert b.old_logprobs.tolist() == [[0, f(-0.1), f(-0.2), f(-0.3), f(-0.4), f(-0.5)],
                                       [0, 0, 0, f(-0.6), 0, 0], [f(-0.7), f(-0.8), 0, 0, 0, 0]]
    assert b.num_tokens == 8
    # no padded position is trained on or attended to
    assert not (b.loss_mask & (b.targets == pad)).any()
    assert not ((b.attention_mask == 1) & (b.input_ids == pad)).any()
    # the padded batch scores each response as a forward of that sample alone does (to fp32 rounding)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        batched = token_logprobs(model, b.input_ids, b.targets, b.attention_mask)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([np.concatenate([p, r]).tolist()])
            alone = token_logprobs(model, ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1]))[0]
            assert torch.allclose(batched[i][b.loss_mask[i]], alone[len(p) - 1:], atol=1e-5), i


def test_batch_rejects_inconsistent_samples():
    with pytest.raises(ValueError, match="len\\(logprobs\\) == len\\(mask\\) == R"):
        assemble_batch([np.array([1])], [np.array([2, 3])], [np.array([-1.0])], [0.0], pad_id=0)
    with pytest.raises(ValueError, match="P >= 1"):
        assemble_batch([np.array([], dtype=np.int64)], [np.array([2])], [np.array([-1.0])], [0.0], 0)
    with pytest.raises(ValueError, match="mask=1"):
        assemble_batch([np.array([1])], [np.array([2, 3])], [np.array([-1.0, -1.0])], [0.0], 0, [np.array([True])])


def test_a_trajectory_trains_its_model_tokens_and_reads_the_environments():
    """Prompt [1, 2]; the model wrote 3, 4; a tool wrote 5, 6; the model wrote 7. Every token is read
    (input and attention), only the model's are targets of the loss, with their advantage and logprob."""
    mask = np.array([1, 1, 0, 0, 1], bool)
    b = assemble_batch([np.array([1, 2])], [np.array([3, 4, 5, 6, 7])],
                       [np.array([-0.1, -0.2, 0.0, 0.0, -0.3], np.float32)], [2.0], pad_id=0, masks=[mask])
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]] and b.targets.tolist() == [[2, 3, 4, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[1] * 6]
    assert b.loss_mask.tolist() == [[False, True, True, False, False, True]]
    assert b.advantages.tolist() == [[0.0, 2.0, 2.0, 0.0, 0.0, 2.0]]
    assert b.old_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, 0.0, -0.3])
    assert b.num_tokens == 3
    every = assemble_batch([np.array([1, 2])], [np.array([3, 4, 5, 6, 7])], [np.zeros(5, np.float32)], [2.0], 0)
    assert every.loss_mask.sum() == 5  # without a mask, every response token is the model's


class Bigram(torch.nn.Module):
    """A model whose logits at a position depend only on the token there: easy to check by hand. It has
    what scoring uses of a Hugging Face causal LM: the final hidden states and the output head."""

    def __init__(self, vocab=7):
        super().__init__()
        self.config = type("Config", (), {})()
        self.embed = torch.nn.Embedding(vocab, vocab)
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():  # logits at a position = table[token there]
            self.embed.weight.copy_(torch.eye(vocab))
            self.head.weight.copy_(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)).T)
        self.table = self.head.weight.T

    def forward(self, input_ids, attention_mask=None, use_cache=False, output_hidden_states=False,
                logits_to_keep=0):
        hidden = self.embed(input_ids)
        return type("Out", (), {"hidden_states": (hidden,), "logits": self.head(hidden[:, -logits_to_keep:])})()

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_are_fp32_temperature_scaled(temperature):
    model = Bigram()
    ids = torch.tensor([[1, 2, 3]])
    tgt = torch.tensor([[2, 3, 4]])
    got = token_logprobs(model, ids, tgt, torch.ones_like(ids), temperature=temperature)
    scale = temperature if temperature > 0 else 1.0
    for t in range(3):
        row = model.table[ids[0, t]].double() / scale
        expected = row[tgt[0, t]] - torch.logsumexp(row, 0)
        assert math.isclose(got[0, t].item(), expected.item(), abs_tol=1e-6)
    assert got.dtype == torch.float32
