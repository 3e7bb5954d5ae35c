"""bench/trainer_profile.py: one trainer step under torch.profiler, its time split by kind of kernel.

Run: pytest tests/test_trainer_profile.py   (the GPU case: python -m pytest -m gpu tests/test_trainer_profile.py -s)
"""

import json
import subprocess
import sys

import pytest

from conftest import IS_GPU, REPO, report

TIMEOUT_S = 300


def profile(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/trainer_profile.py", "--out", str(tmp_path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def checked_split(result: dict) -> dict:
    """The result's split, checked: every kind there, none negative, together no more than the step."""
    split = result["seconds_by_kind"]
    assert all(s >= 0 for s in split.values()) and sum(split.values()) <= result["step_s"] * 1.001
    assert split["matrix multiply"] > 0
    top = result["top"]
    assert top and [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    return split


def test_the_cpu_step_is_split_by_operator(tmp_path):
    done = profile(tmp_path, "--samples", "16", "--prompt", "20", "--response", "48", "--micro-batch-tokens", "400")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "trainer_profile_cpu.json").read_text())
    assert result["complete"] and result["mfu"] is None and result["shape"] == "small policy"
    split = checked_split(result)
    assert "GPU idle (host)" not in split and split["attention"] > 0 and split["optimizer"] > 0
    assert result["top"][0]["name"] == "aten::mm"  # the small policy's step is its matrix multiplies
    ops = result["top_operators"]  # ... and which: each operator with the shapes it ran on
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert ops[0]["name"].startswith("aten::mm [[")
    assert "matrix multiply" in done.stdout and "wrote" in done.stdout


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matrix multiply"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matrix multiply"),
    # as an H100 names it: CUTLASS's types inside, and attention all the same
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, "
     "4, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >>",
     "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "softmax / log-probs"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
     "optimizer"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copy / cast"),
    ("Memcpy DtoD (Device -> Device)", "copy / cast"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> > >>", "elementwise / reductions"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "elementwise / reductions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
     "elementwise / reductions"),
])
def test_kernels_are_told_apart_by_name(monkeypatch, name, kind):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from trainer_profile import kind_of
    assert kind_of(name) == kind


def test_a_bad_count_is_one_line(tmp_path):
    done = profile(tmp_path, "--samples", "0")
    assert done.returncode == 2 and "--samples" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not IS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_gpu_step_at_the_0_5b_shape_is_split_by_kernel(tmp_path, compiled):
    done = profile(tmp_path, "--device", "cuda", "--shape", "0.5b", *(["--compile"] if compiled else []))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "trainer_profile_cuda.json").read_text())
    report(f"trainer_profile_0.5b{'_compiled' if compiled else ''}", result)
    split = checked_split(result)
    assert split["attention"] > 0 and split["optimizer"] > 0 and 0 < result["mfu"] < 1
    assert any(" [[" in o["name"] for o in result["top_operators"])  # operators named with their shapes
