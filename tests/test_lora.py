"""LoRA (`trainer.lora_rank > 0`): only the adapters train, the engine gets the merged model, the
reference is the base with its adapters off, checkpoints hold the adapters and name their base.

Run: pytest tests/test_lora.py (the shipped small policy on CPU, fp32).
"""

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.run.cli import UserError
from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer import lora
from nano_miles.stages.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from nano_miles.stages.trainer.learner import Learner
from nano_miles.weights.named_tensors import (WeightUpdateError, base_parts, merged_weight,
                                             trainable_named_tensors)
from test_learner import TEMPERATURE, make_samples

LORA = dict(lora_rank=4, lora_alpha=8.0)


@pytest.fixture
def base(policy_dir):
    return lambda: AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)


def trained(model, steps: int = 3, **overrides) -> Learner:
    learner = Learner(TrainerConfig(lr=1e-2, **overrides), model, pad_id=0, temperature=TEMPERATURE, max_new_tokens=40)
    for seed in range(steps):
        learner.step(make_samples(12, seed=seed))
    return learner


def test_only_the_adapters_train(base):
    reference = base()
    model = lora.wrap(base(), TrainerConfig(**LORA))
    learner = trained(model, **LORA)
    frozen = dict(reference.named_parameters())
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert sum(p.numel() for p in learner.trained) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    for name, p in model.get_base_model().named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, frozen[name.replace(".base_layer.", ".")]), name  # bit for bit
    assert any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if ".lora_B." in n)  # B starts at 0


def test_the_engine_is_sent_the_merged_model(base):
    model = lora.wrap(base(), TrainerConfig(**LORA))
    trained(model, **LORA)
    sent = trainable_named_tensors(model)
    plain = base()
    assert [n for n, _ in sent] == [n for n, _ in plain.named_parameters()]  # the served model's own names
    plain.load_state_dict(dict(sent), strict=False)
    ids = torch.as_tensor(make_samples(1, seed=7)[0].prompt)[None]
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)
        merged = model.merge_and_unload()  # PEFT's own merge, for comparison (changes `model`)
    for (name, t), (_, expected) in zip(sent, merged.named_parameters()):
        assert torch.allclose(t, expected, atol=1e-6), name


def test_a_merge_into_the_push_buffer_is_the_fp32_merge_in_its_dtype(base, policy_dir):
    """The flat push merges straight into its buffer: into fp32 bit for bit the fp32 merge; into bf16, from
    a bf16 base and fp32 adapters (the GPU configs'), the fp32 merge rounded, within bf16's rounding."""
    model = lora.wrap(base(), TrainerConfig(**LORA))
    trained(model, **LORA)
    for _, _, layer in base_parts(model):
        if layer is not None:
            expected = merged_weight(layer)
            assert torch.equal(merged_weight(layer, out=torch.empty_like(expected)), expected)
    bf16_base = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.bfloat16)
    model = lora.wrap(bf16_base, TrainerConfig(**LORA, dtype="bfloat16"))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.05)  # adapters far from zero (B starts at 0)
    layers = [layer for _, _, layer in base_parts(model) if layer is not None]
    assert layers and all(layer.lora_A[a].weight.dtype == torch.float32
                          for layer in layers for a in layer.active_adapters)
    for layer in layers:
        expected = merged_weight(layer).to(torch.bfloat16)
        got = merged_weight(layer, out=torch.empty_like(expected))
        assert (expected != layer.base_layer.weight).float().mean() > 0.5  # the adapters change the weight
        # apart by a rounding of the result and of A and B (bf16's step: 2^-8 relative, 2^-7 as a bound)
        a, b = (m[layer.active_adapters[0]].weight.detach() for m in (layer.lora_A, layer.lora_B))
        bound = 2**-7 * (expected.float().abs() + layer.scaling[layer.active_adapters[0]] * (b.abs() @ a.abs()))
        assert ((got.float() - expected.float()).abs() <= bound).all()


def test_the_kl_reference_is_the_base_with_its_adapters_off(base):
    model = lora.wrap(base(), TrainerConfig(**LORA))
    learner = trained(model, **LORA, kl_coef=0.1)
    assert learner.reference is None  # no second copy of the weights
    samples = make_samples(4, seed=9)
    batch = learner.assemble(samples, [0.0] * len(samples))
    with torch.no_grad():
        ref = learner.reference_logprobs(batch)
        assert torch.equal(ref, learner.logprobs(base(), batch))
        assert not torch.allclose(ref, learner.logprobs(model, batch))  # the adapters did learn something


def test_wrong_target_modules_are_one_line(base):
    with pytest.raises(UserError, match=r"lora_target_modules names qkv, which this model has no linear layer of"):
        lora.wrap(base(), TrainerConfig(lora_rank=4, lora_target_modules=["q_proj", "qkv"]))
    assert lora.wrap(m := base(), TrainerConfig()) is m  # rank 0: the model as it is


def test_a_checkpoint_holds_the_adapters_and_names_the_base(base, policy_dir, tmp_path):
    from transformers import AutoTokenizer
    identity = lora.base_identity(policy_dir)
    model = lora.wrap(base(), TrainerConfig(**LORA))
    learner = trained(model, **LORA)
    path = save_checkpoint(tmp_path, model, AutoTokenizer.from_pretrained(str(policy_dir)), learner,
                           TrainerState(step=3, version=3), identity)
    assert (path / lora.ADAPTER_WEIGHTS).is_file() and not (path / "model.safetensors").exists()
    assert sum(f.stat().st_size for f in path.iterdir()) < 0.5 * (policy_dir / "model.safetensors").stat().st_size
    again = lora.wrap(base(), TrainerConfig(**LORA))
    resumed = Learner(TrainerConfig(lr=1e-2, **LORA), again, pad_id=0, temperature=TEMPERATURE, max_new_tokens=40)
    assert load_checkpoint(path, again, resumed, identity).step == 3
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    samples = make_samples(12, seed=5)  # the next step of both is the same step, bit for bit
    learner.step(samples), resumed.step(samples)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    other = {**identity, "sha256": "0" * 64}
    with pytest.raises(WeightUpdateError, match="trained on the base model"):
        load_checkpoint(path, lora.wrap(base(), TrainerConfig(**LORA)), resumed, other)
    with pytest.raises(WeightUpdateError, match="holds LoRA adapters and the trainer trains the whole model"):
        full = base()
        load_checkpoint(path, full, Learner(TrainerConfig(), full, pad_id=0, temperature=1.0), None)
    wider = lora.wrap(base(), TrainerConfig(lora_rank=8))
    with pytest.raises(WeightUpdateError, match="do not fit"):
        load_checkpoint(path, wider, Learner(TrainerConfig(lora_rank=8), wider, pad_id=0, temperature=1.0), identity)


def test_the_config_refuses_bad_lora_keys():
    from nano_miles.run.config import ConfigError, load_config
    for bad in ("--trainer.lora_rank=-1", "--trainer.lora_alpha=0", "--trainer.lora_dropout=1",
                "--trainer.lora_target_modules=[]", '--trainer.lora_target_modules=["q proj"]'):
        with pytest.raises(ConfigError, match="trainer.lora_"):
            load_config(overrides=[bad])
    assert np.isclose(load_config(overrides=["--trainer.lora_rank=16"]).trainer.lora_alpha, 32.0)


def test_micro_batches_and_checkpointing_give_the_adapters_the_whole_batch_step(base):
    samples = make_samples(12, seed=3)
    steps = {}
    for name, extra in (("whole", {}), ("micro", dict(micro_batch_tokens=60, gradient_checkpointing=True))):
        model = lora.wrap(base(), TrainerConfig(**LORA))
        torch.manual_seed(0)  # the same fresh adapters (PEFT draws A at random)
        for p in (p for n, p in model.named_parameters() if ".lora_A." in n):
            torch.nn.init.normal_(p, std=0.02)
        learner = Learner(TrainerConfig(**LORA, **extra), model, pad_id=0, temperature=TEMPERATURE, max_new_tokens=40)
        result, _ = learner.step(samples)
        steps[name] = (result, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (whole, grads), (micro, micro_grads) = steps["whole"], steps["micro"]
    assert micro.num_micro_batches > 1 and micro.pg_loss == pytest.approx(whole.pg_loss, abs=1e-5)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert scale > 0
    for n, g in grads.items():
        assert (micro_grads[n] - g).abs().max() <= 1e-5 * scale, n


def test_export_refuses_adapters_of_a_full_fine_tune(base, policy_dir, tmp_path):
    from transformers import AutoTokenizer

    from nano_miles.export import export
    model = base()
    save_checkpoint(tmp_path / "checkpoints", model, AutoTokenizer.from_pretrained(str(policy_dir)),
                    Learner(TrainerConfig(), model, pad_id=0, temperature=1.0), TrainerState(step=1, version=1))
    with pytest.raises(UserError, match="--adapter: .* is a full fine-tune's checkpoint, which holds no adapters"):
        export(tmp_path, tmp_path / "out", adapter=True)


@pytest.mark.slow
def test_a_lora_run_learns_and_exports_the_merged_model_and_the_adapters(policy_dir, tmp_path):
    import subprocess
    import sys

    from peft import PeftModel

    from harness.learning_runs import LORA as RUN, margin
    from harness.servers import REPO_ROOT
    from harness.supervised_run import SupervisedRun
    run = SupervisedRun(tmp_path / "run", RUN).start()
    try:
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    records, s = run.metrics(), run.summary()
    assert [r["step"] for r in records] == list(range(1, 33))
    assert all(r["version"] == r["step"] for r in records), "engine weights must follow every step"
    assert all(r["parity"] < 1e-4 for r in records), "the engine must serve the merged adapters"
    # half the smallest gain of five seeds (bench/results/learning_seeds.json, config "lora")
    assert s["eval_accuracy_max"] - s["eval_accuracy_start"] >= margin("lora", "eval_gain"), s
    assert s["ledger"]["num_lost"] == 0 and s["ledger"]["num_trained_twice"] == 0
    checkpoint = run.run_dir / "checkpoints" / "step_000032"
    assert (checkpoint / lora.ADAPTER_WEIGHTS).is_file() and not (checkpoint / "model.safetensors").exists()
    for out, extra in (("merged", []), ("adapter", ["--adapter"])):
        done = subprocess.run([sys.executable, "-m", "nano_miles.export", str(run.run_dir), str(tmp_path / out),
                               *extra], cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    ids = torch.as_tensor(make_samples(1, seed=11)[0].prompt)[None]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(ids).logits
        base_model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base_model, str(tmp_path / "adapter"))(ids).logits
        served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))(ids).logits  # transformers' own
        plain = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4) and torch.allclose(served, adapted, atol=1e-5)
    assert not torch.allclose(merged, plain, atol=1e-3)  # the adapters changed the model


@pytest.mark.parametrize("options", [dict(recompute_old_logprobs=True), dict(entropy_coef=0.01),
                                     dict(kl_coef=0.05, kl_in="reward"), dict(loss="gspo"), dict(loss="cispo"),
                                     dict(num_iterations=2, mini_batches=2), dict(advantage="rloo")])
def test_every_loss_and_estimator_trains_the_adapters_alone(base, options):
    model = lora.wrap(base(), TrainerConfig(**LORA))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result, _ = Learner(TrainerConfig(lr=1e-2, **LORA, **options), model, pad_id=0, temperature=TEMPERATURE,
                        max_new_tokens=40).step(make_samples(12, seed=4))
    assert math.isfinite(result.pg_loss) and result.num_skipped_steps == 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed), options


@pytest.mark.slow
def test_an_async_lora_run_follows_every_version(tmp_path):
    from harness.supervised_run import SupervisedRun
    run = SupervisedRun(tmp_path / "run", ["--run.mode=async", "--run.max_staleness=2", "--trainer.num_steps=6",
                                           "--trainer.batch_groups=4", "--rollout.group_size=4", "--trainer.eval_every=0",
                                           "--task.num_test=10", "--trainer.lora_rank=8"]).start()
    try:
        assert run.wait(timeout_s=300) == 0, run.tail()
    finally:
        run.stop()
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 7)) and all(r["version"] == r["step"] for r in records)
    assert all(r["staleness_max"] <= 2 for r in records)
    on_policy = [r for r in records if r["staleness_max"] == 0]  # the engine's samples of the trainer's weights
    assert on_policy and all(r["parity"] < 1e-4 for r in on_policy)
    assert run.summary()["ledger"]["num_trained_twice"] == 0
