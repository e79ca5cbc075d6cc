"""The lora scenario's pure logic, without ranks: names, the LoRA checks, the merge bound, the session side."""

from __future__ import annotations

import numpy as np
import pytest

from pytest_gpuregress.faults import parse
from pytest_gpuregress.findings import CheckFinding
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import Setup, registry
from pytest_gpuregress.scenarios.lora import DEFAULT_TARGETS, SCENARIO, bounds, checks
from pytest_gpuregress.triage.naming import described, rule_for

Q_B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"
Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"
SAVED_Q_B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
BASE_Q = "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"
MODULE = "model.layers.1.self_attn.q_proj"
CPU = Setup(device_kind="cpu", backend="gloo", world_size=2)


def messages(findings: list[checks.Finding]) -> list[str]:
    """The report's lines, less the rule id they end with (``rules`` asserts those)."""
    return [described(CheckFinding.of(f)).rpartition(" (rule ")[0] for f in findings]


def rules(findings: list[checks.Finding]) -> list[tuple[str, str]]:
    """(component, rule id) that triage names each finding by."""
    return [(rule.component, rule.id) for rule in map(rule_for, map(CheckFinding.of, findings))]


def trained(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {Q_A: rng.normal(0, 0.1, (8, 64)).astype(np.float32), Q_B: rng.normal(0, 0.01, (64, 8)).astype(np.float32)}


def test_adapter_names_are_described_by_tensor_and_module() -> None:
    assert checks.split_adapter_name(Q_B) == (MODULE, "lora_B")
    assert checks.split_adapter_name(SAVED_Q_B) == (MODULE, "lora_B")
    assert checks.split_adapter_name(BASE_Q) is None
    assert checks.describe(Q_B) == f"lora_B of {MODULE}"
    assert checks.describe(BASE_Q) == f"{MODULE}.base_layer.weight"
    assert checks.canonical(Q_B) == SAVED_Q_B


def test_frozen_base_names_the_leaking_and_the_changed_weight_and_what_moved_it() -> None:
    base = f"{MODULE}.base_layer.weight"
    found = checks.check_frozen({BASE_Q: 0}, {BASE_Q: "aa", "x.weight": "bb"}, {BASE_Q: "cc", "x.weight": "bb"})
    assert [(f["check"], f["facts"]) for f in found] == [("frozen-base", {"left_trainable": True})] * 2
    assert rules(found) == [("library: peft", "lora-base-left-trainable")] * 2
    leaked, stepped = messages(found)  # the leak, then the move it made: each names the weight and the step
    assert leaked.startswith(f"[library: peft] lora check 'frozen-base': frozen base weight {base} "), leaked
    assert "received a gradient at step 0 " in leaked and leaked.endswith("the library left it trainable")
    assert stepped.startswith(f"[library: peft] lora check 'frozen-base': base weight {base} "), stepped
    assert "changed during training: " in stepped and stepped.endswith("the gradient it received from step 0")
    moved = checks.check_frozen({}, {BASE_Q: "aa"}, {BASE_Q: "cc"})  # no gradient, yet it moved
    assert [(f["check"], f["facts"]) for f in moved] == [("frozen-base", {})]
    assert rules(moved) == [("optimizer or collective", "lora-base-moved")]
    [written] = messages(moved)
    assert written.startswith(f"[optimizer or collective] lora check 'frozen-base': base weight {base} "), written
    assert "without ever receiving a gradient" in written and "no longer bit-identical" in written
    assert checks.check_frozen({}, {BASE_Q: "aa"}, {BASE_Q: "aa"}) == []


def test_nonzero_finds_missing_empty_and_zero_adapters() -> None:
    tensors = trained()
    assert checks.check_nonzero(tensors, [MODULE]) == []
    tensors[Q_B] = np.zeros_like(tensors[Q_B])
    tensors[Q_A] = np.zeros((0, 64), np.float32)
    up = "model.layers.0.mlp.up_proj"
    raw = checks.check_nonzero(tensors, [MODULE, up])
    assert [(f["check"], f["facts"]) for f in raw] == [("adapter-nonzero", {"missing": True})] * 2 + \
        [("adapter-nonzero", {})] * 2
    found = messages(raw)
    assert f"lora_A of {up} is missing: " in found[0] and f"lora_B of {up} is missing: " in found[1]
    missing = CheckFinding.of(raw[0])
    assert rule_for(missing).id == "lora-adapter-missing"  # no adapter built at all: peft's, not the optimizer's
    assert any(f"lora_A of {MODULE} is empty" in m and m.endswith("(shape [0, 64])") for m in found)
    assert any(f"lora_B of {MODULE} is all zeros" in m and m.endswith(" after training") for m in found)


def test_saved_slice_zeros_and_missing_keys_are_named() -> None:
    full = trained()
    good = {checks.canonical(n): v for n, v in full.items()}
    assert checks.check_saved(good, full, world_size=2) == []
    sliced = {**good, checks.canonical(Q_A): full[Q_A][:4]}
    found = checks.check_saved(sliced, full, 2)
    assert [f["check"] for f in found] == ["sharded-save"] and rules(found) == [("checkpoint", "lora-sharded-save")]
    [sliced_line] = messages(found)
    assert f"lora_A of {MODULE} saved with shape [4, 64]" in sliced_line and "full tensor is [8, 64]" in sliced_line
    assert sliced_line.endswith("one rank's slice, not every rank's"), sliced_line
    zeroed = {**good, SAVED_Q_B: np.zeros_like(full[Q_B])}
    found = checks.check_saved(zeroed, full, 2)
    assert rules(found) == [("checkpoint", "lora-adapter-roundtrip")]
    assert [(f["check"], f["message"]) for f in found] == [("adapter-roundtrip", f"lora_B of {MODULE} is all zeros "
                                                                                 "in the saved file")]
    nudged = {**good, SAVED_Q_B: np.nextafter(full[Q_B], np.float32(1))}
    assert "differs in 512 of 512 elements" in messages(checks.check_saved(nudged, full, 2))[0]
    assert "is missing from the saved adapter" in messages(checks.check_saved({SAVED_Q_B: full[Q_B]}, full, 2))[0]


def test_reloaded_zeros_read_as_the_issue_says() -> None:
    full = trained()
    assert checks.check_reloaded(dict(full), full) == []
    found = checks.check_reloaded({**full, Q_B: np.zeros_like(full[Q_B])}, full)
    assert rules(found) == [("checkpoint", "lora-adapter-roundtrip")]
    assert [(f["check"], f["message"]) for f in found] == [("adapter-roundtrip", f"{checks.describe(Q_B)} is all zeros "
                                                                                 "after reload")]


def test_logits_check_is_bitwise_at_bound_zero() -> None:
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    assert checks.check_logits("merge", "x", a, a.copy(), 0.0) == []
    found = messages(checks.check_logits("adapter-roundtrip", "reloaded", a, np.nextafter(a, np.float32(2)), 0.0))
    assert "beyond bit for bit" in found[0]
    assert checks.check_logits("merge", "x", a, a + 1e-7, 1e-6) == []


def peft_merge_fp32(base: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float) -> np.ndarray:
    """What peft does in fp32: W + (B @ A) * s, each step rounded to fp32."""
    delta = (lora_b @ lora_a).astype(np.float32) * np.float32(scale)
    return (base + delta).astype(np.float32)


@pytest.mark.parametrize("b_std", [1e-4, 1e-2, 0.3])
def test_merge_bound_holds_for_a_correct_fp32_merge(b_std: float) -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(0, 0.02, (64, 64)).astype(np.float32)
    lora_a = rng.normal(0, 0.07, (8, 64)).astype(np.float32)
    lora_b = rng.normal(0, b_std, (64, 8)).astype(np.float32)
    merged = peft_merge_fp32(base, lora_a, lora_b, 2.0)
    excess = bounds.merge_excess(merged, base, lora_a, lora_b, 2.0, "fp32")
    assert excess.count == 0 and 0 < excess.worst_ratio <= 1


def test_one_ulp_in_a_merged_layer_breaks_the_bound_while_the_delta_is_small() -> None:
    rng = np.random.default_rng(2)
    base = rng.normal(0, 0.02, (64, 64)).astype(np.float32)
    lora_a = rng.normal(0, 0.07, (8, 64)).astype(np.float32)
    lora_b = rng.normal(0, 1e-3, (64, 8)).astype(np.float32)
    merged = np.nextafter(peft_merge_fp32(base, lora_a, lora_b, 2.0), np.float32(np.inf))
    off = checks.check_merged_weight(MODULE, merged, base, lora_a, lora_b, 2.0, "fp32")
    assert messages(off)[0].startswith(f"[kernel] lora check 'merge': merged weight of {MODULE} is off ")
    assert rules(off) == [("kernel", "lora-merge-rounding")]  # one ulp is no multiple of the adapter's product


@pytest.mark.parametrize(("factor", "meaning"), [(2.0, "the adapter's scaling 2 applied twice"),
                                                  (0.5, "the adapter's scaling 2 left out"),
                                                  (0.0, "the adapter was not merged")])
def test_a_merge_off_by_an_exact_factor_is_the_librarys_arithmetic_not_a_kernel(factor: float, meaning: str) -> None:
    """A merged weight that is W + k * scale * B @ A within rounding (the scaling applied twice: k = scale) is no
    kernel's rounding, however many rounding bounds off it is: peft's arithmetic, with k and what it means."""
    rng = np.random.default_rng(3)
    base = rng.normal(0, 0.02, (64, 64)).astype(np.float32)
    lora_a = rng.normal(0, 0.07, (8, 64)).astype(np.float32)
    lora_b = rng.normal(0, 0.01, (64, 8)).astype(np.float32)
    merged = peft_merge_fp32(base, lora_a, lora_b, 2.0 * factor)
    off = checks.check_merged_weight(MODULE, merged, base, lora_a, lora_b, 2.0, "fp32")
    assert rules(off) == [("library: peft", "lora-merge-arithmetic")]
    assert off[0]["facts"]["factor"] == pytest.approx(factor, abs=1e-5) and meaning in off[0]["message"]


def test_ulp_matches_numpy_spacing_for_fp32() -> None:
    values = np.array([1.0, 1.5, 0.02, -3e-5, 2.0**-126], dtype=np.float32)
    assert np.array_equal(bounds.ulp(values, "fp32"), np.spacing(np.abs(values)).astype(np.float64))
    assert bounds.ulp(np.array([1.0]), "bf16")[0] == 2.0**-7


def test_logits_bound_grows_with_the_chain_and_the_dtype() -> None:
    fp32 = bounds.logits_bound(1.0, [64, 64], 8, "fp32")
    assert fp32 == pytest.approx((2 * (3 * 64 + 8 + 3)) * 2.0**-24)
    assert bounds.logits_bound(1.0, [64, 64], 8, "bf16") == pytest.approx(fp32 * 2.0**16)
    with pytest.raises(ValueError):
        bounds.gamma(300, 2.0**-8)


def test_findings_of_other_ranks_are_kept_and_labelled() -> None:
    shared = checks.finding("merge", "m")
    only1 = checks.finding("frozen-base", "f")
    merged = checks.merge_findings([[shared], [shared, only1]])
    assert [f["message"] for f in merged] == ["m", "f (on rank 1)"]


def test_repeated_findings_of_one_check_are_capped() -> None:
    shown = checks.shown_findings([checks.finding("sharded-save", f"t{i}") for i in range(6)], per_check=4)
    assert len(shown) == 5 and shown[-1].message == "... and 2 more findings like these"
    # A finding of another kind (another rule of the same check) is never hidden behind a capped kind.
    leaks = [checks.finding("frozen-base", f"leak {i}", left_trainable=True) for i in range(6)]
    moved = checks.finding("frozen-base", "moved without a gradient")
    assert [rule_for(f).id for f in checks.shown_findings([*leaks, moved])] == \
        ["lora-base-left-trainable"] * 4 + ["lora-base-moved", "lora-base-left-trainable"]  # the last: "... and 2 more"
    assert described(shown[-1]).startswith("[checkpoint] lora check 'sharded-save': ... and 2 more")


def test_scenario_is_registered_with_one_case_and_reference_folder_per_wrapper() -> None:
    assert registry()["lora"] is SCENARIO
    cases = SCENARIO.cases(CPU)
    assert [c.id for c in cases] == ["fully_shard", "accelerate", "fully_shard-resume", "accelerate-resume"]
    launches = SCENARIO.launches(cases, CPU)
    assert [la.config["wrapper"] for la in launches] == ["fsdp2", "accelerate"]
    config = launches[0].config
    assert config["target_modules"] == list(DEFAULT_TARGETS) and config["steps"] == 300
    assert config["lora_r"] == 8 and config["lora_alpha"] == 16 and config["dtype"] == "fp32"
    assert SCENARIO.platform_tag(config) == "fp32-fsdp2"
    assert {SCENARIO.reference_name(c) for c in cases} == {"lora"}
    replicas = SCENARIO.noise_replicas(launches[1], CPU, 3)
    assert len(replicas) == 3 and all(r.config["wrapper"] == "accelerate" and r.config["perturbation"] for r in replicas)


def test_target_option_overrides_the_default() -> None:
    setup = Setup(device_kind="cpu", backend="gloo", world_size=2, steps=8,
                  options={"gpuregress_lora_targets": ["q_proj", "v_proj"]})
    config = SCENARIO.default_config(setup)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["steps"] == 8


def test_verdict_formats_findings_and_flags_checks_that_did_not_run() -> None:
    zeros = f"{checks.describe(Q_B)} is all zeros after reload"
    record = RunRecord(scenario="lora", config={}, platform_key="", world_size=2,
                       results={"lora_checks": [checks.finding("adapter-roundtrip", zeros)],
                                "lora_checks_run": sorted(set(checks.CHECKS) - {"merge"})})
    problems = SCENARIO.own_findings(SCENARIO.cases(CPU)[0], record, CPU)
    assert problems == [CheckFinding("adapter-roundtrip", zeros, scope="lora check"),
                        CheckFinding("lora-missing", "lora checks did not run: merge")]
    named = [rule_for(p) for p in problems if isinstance(p, CheckFinding)]
    assert [(r.component, r.id) for r in named] == [("checkpoint", "lora-adapter-roundtrip"),
                                                     ("checkpoint", "lora-checks-missing")]
    assert described(problems[1]) == f"[checkpoint] {problems[1].message} (rule lora-checks-missing)"
    assert described(problems[0]) == f"[checkpoint] lora check 'adapter-roundtrip': {zeros} (rule lora-adapter-roundtrip)"


def test_lora_fault_specs_are_validated() -> None:
    spec = parse("lora:mode=merge_ulp,layer=0,proj=down_proj")
    assert spec.get("mode") == "merge_ulp" and spec.get("layer") == 0
    from pytest_gpuregress.faults.lora import target_module

    assert target_module(spec) == "model.layers.0.mlp.down_proj"
    assert target_module(parse("lora:mode=grad_leak")) == MODULE
    with pytest.raises(Exception, match="mode"):
        parse("lora:mode=nonsense")


def test_the_docs_table_of_check_rules_is_triages() -> None:
    from pathlib import Path

    from pytest_gpuregress.triage import naming as scenario_checks

    text = (Path(__file__).resolve().parents[3] / "docs" / "lora.md").read_text()
    begin, end = "<!-- check-rules:begin -->", "<!-- check-rules:end -->"
    assert text[text.index(begin) + len(begin):text.index(end)].strip().splitlines() == scenario_checks.markdown_table()
    assert set(scenario_checks.CHECKS) == set(checks.CHECKS)  # every check a run makes has a rule that names it
