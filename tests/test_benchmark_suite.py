"""benchmarks/suite.py's parts P1, P4, P5, P7 and P8 run as a user runs them, at sizes for CI: a part that
rots (an import the restructure moved, a model option renamed) fails here, not in front of a user;
`--only P6` hands its sizes to benchmarks/scale.py (run end to end in tests/test_scale_benchmark.py).
The figures themselves are machine-dependent and belong to the benchmark, not to assertions here."""

import math

import pytest
import torch

from benchmarks.suite import (
    p1_train_step,
    p4_generation_and_data,
    p5_gpu,
    p7_length_groups,
    p8_attention_kernel,
)


def test_p1_times_every_encoding_against_hf_llama():
    # compile_too=False: compiling costs tens of seconds here; the compiled train step is tested
    # (same steps as eager) in tests/test_train.py
    r = p1_train_step(d_model=32, n_layers=1, n_heads=2, seq=16, batch=2, vocab=32, repeats=1, compile_too=False)
    names = {"ours_nope", "ours_learned", "ours_rope", "ours_alibi"}
    assert names <= set(r["models"])
    for name in names:
        m = r["models"][name]
        assert m["tokens_per_s"] > 0 and m["gflops"] > 0 and m["non_embedding_params"] > 0, name
    assert "ours_rope_compiled" not in r["models"] and "compile" not in r
    assert r["bf16_mixed_speedup"] > 0 and r["models"]["ours_rope_bf16_mixed"]["tokens_per_s"] > 0
    if "hf_llama" in r["models"]:
        assert r["models"]["hf_llama"]["vs_hf_llama"] == pytest.approx(1.0)


def test_p4_generation_with_the_cache_writes_the_same_tokens_and_trial_configs_step():
    # two trial configs (one with PPC's position head): all of them take a minute here
    r = p4_generation_and_data(repeats=1, configs=("sparse_parity", "parity_ppc"))
    assert set(r["generation"]) == {"1x", "2x", "4x"}
    for row in r["generation"].values():
        assert row["tokens_agree"] == 1.0 and row["new_tokens"] > 0
    assert set(r["data"]) == {"sparse_parity", "parity_ppc"}
    assert all(0 < row["share"] < 1 and math.isfinite(row["step_s"]) for row in r["data"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, P5 runs for minutes: run it as a benchmark")
def test_p5_says_it_needs_a_gpu_on_a_cpu_machine():
    assert "no CUDA" in p5_gpu()["skipped"]


def test_p7_times_a_claims_cells_in_length_groups_and_counts_the_padding_they_skip():
    r = p7_length_groups(steps=2, claims=("randomized_reversal_tokens",))
    assert set(r) == {"reverse, learned, sequential, encoder", "reverse, learned, randomized, encoder"}
    for row in r.values():
        assert row["one_batch_s"] > 0 and row["grouped_s"] > 0 and row["speedup"] > 0
        assert 0 < row["not_padding_one"] < row["not_padding_grouped"] <= 1


def test_p8_times_bf16_attention_kernels_by_keys_and_a_bf16_claim_cells_step_with_each():
    r = p8_attention_kernel(keys=(16, 256), repeats=1, steps=2, claims=("abacus_addition",))
    assert set(r["kernels"]) == {"16", "256"}
    assert all(row["flash_s"] > 0 and row["math_s"] > 0 for row in r["kernels"].values())
    assert set(r["cells"]) == {"addition, nope, sequential, abacus", "addition, learned, random_shift"}
    assert all(c["flash_s"] > 0 and c["chosen_s"] > 0 for c in r["cells"].values())
    import models.decoder

    assert models.decoder.MATH_ATTENTION_MAX_KEYS == 128  # restored after the flash-only steps


def test_the_suites_p6_hands_its_sizes_to_the_scale_benchmark(monkeypatch, tmp_path):
    """`--only P6` is benchmarks/scale.py's P6 (run end to end in tests/test_scale_benchmark.py): the
    suite passes its sizes through and writes what comes back."""
    import json

    import benchmarks.scale
    from benchmarks import suite

    called = {}

    def fake_p6(trials, nodes, profile_dir=None):
        called.update(trials=trials, nodes=nodes, profile_dir=profile_dir)
        return {"cluster": {"nodes": nodes}}

    monkeypatch.setattr(benchmarks.scale, "p6_scale", fake_p6)
    monkeypatch.setattr(benchmarks.scale, "print_p6", lambda r: None)
    out = tmp_path / "p6.json"
    assert suite.main(["--only", "P6", "--trials", "6", "9", "--nodes", "3", "--p6-profile", "prof",
                       "--json", str(out)]) == 0
    assert called == {"trials": [6, 9], "nodes": 3, "profile_dir": "prof"}
    assert json.loads(out.read_text())["P6"]["cluster"] == {"nodes": 3}
