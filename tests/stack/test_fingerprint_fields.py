"""The fingerprint's fields are declared once (stack/fingerprint_fields.py, #38 item 2): what collect() records,
the exact lane's key, perf's hardware, the summary's upgrades, known issues' names and the docs all follow."""

from __future__ import annotations

from pathlib import Path

from pytest_gpuregress.stack import devices, fingerprint, known_issues
from pytest_gpuregress.stack import fingerprint_fields as schema

DOCS = Path(__file__).resolve().parents[2] / "docs" / "known_issues.md"


def test_collect_records_exactly_the_declared_fields() -> None:
    """A field added to collect() and not declared (or declared and never recorded) fails here."""
    recorded = fingerprint.collect("cpu", "gloo", 2, bf16=True)
    assert list(recorded) == list(schema.SECTIONS)
    for section in schema.SECTIONS:
        declared = {f.name for f in schema.FIELDS if f.section == section and f.on_cpu}
        prefix = schema.PREFIXED.get(section)
        assert {k for k in recorded[section] if not (prefix is not None and k.startswith(prefix))} == declared, section


def test_every_judgement_reads_the_one_declaration() -> None:
    assert fingerprint.NUMERICS_FIELDS["device"] == schema.names("device", exact=True)
    assert "mig" not in fingerprint.NUMERICS_FIELDS["device"] and "firmware" not in fingerprint.NUMERICS_FIELDS["device"]
    assert set(devices.DEVICE_FIELDS) == {"dnn", "blas_library", "mig", "firmware"}
    assert known_issues.FIELDS["comm"] == {"backend", "world_size", "nccl_version", "rccl"}  # env by prefix
    assert {f.key for f in schema.FIELDS} >= set(schema.SOFTWARE_KEYS)
    # a software change is never dropped from the one-line summary, a hardware one may be
    changes = [(f"device.{k}", "a", "b") for k in ("cpu_model", "machine", "mig", "count")] + \
        [("device.driver", "550", "560")]
    assert "device.driver: 550 -> 560" in fingerprint.summarize_changes(changes, others_shown=0)


def test_the_docs_table_is_the_declarations() -> None:
    text = DOCS.read_text()
    shown = text[text.index(schema.BEGIN) + len(schema.BEGIN): text.index(schema.END)].strip().splitlines()
    assert shown == schema.markdown_table(), \
        "regenerate with: python -m pytest_gpuregress.stack.fingerprint_fields docs/known_issues.md"
