"""Every model type's status, generated from the code (swarm_client/families/support.py), and the refusal of
families that keep a recurrent state per session: a clear error naming why, before any weight is read."""

from __future__ import annotations

import pytest
import transformers
from transformers import AutoConfig

from swarm_client.families import get_family, supported_model_types
from swarm_client.families.support import DOC, documented, markdown, support_table


@pytest.mark.parametrize(
    ("model_type", "evidence"),
    [
        ("qwen3_next", "linear_attention"),  # Gated DeltaNet beside full attention
        ("jamba", "mamba"),
        ("falcon_h1", "mamba_d_state"),
        ("lfm2", "conv_L_cache"),  # short convolutions
        ("rwkv", "RWKV"),
        ("mamba", "linear_attention"),
    ],
)
def test_recurrent_families_are_refused_naming_why(model_type: str, evidence: str) -> None:
    with pytest.raises(ValueError) as refused:
        get_family(AutoConfig.for_model(model_type))
    message = str(refused.value)
    assert "recurrent state per session" in message and evidence in message, message
    assert "llama" in message  # what is supported instead


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "gpt_oss", "deepseek_v3"])
def test_attention_only_families_without_a_family_say_not_supported(model_type: str) -> None:
    with pytest.raises(ValueError, match="is not supported; supported: ") as refused:
        get_family(AutoConfig.for_model(model_type))
    assert "recurrent" not in str(refused.value)


def test_served_types_resolve_and_every_row_agrees_with_get_family() -> None:
    rows = {row.model_type: row for row in support_table()}
    assert {t for t, row in rows.items() if row.status == "served"} == set(supported_model_types())
    for model_type, row in rows.items():
        if row.status == "refused":
            with pytest.raises(ValueError, match="recurrent state per session"):
                get_family(AutoConfig.for_model(model_type))


def test_the_documented_table_is_the_generated_one() -> None:
    text = DOC.read_text()
    table = documented(text)
    assert table is not None, f"{DOC} lost its generated model-type table"
    version = f"Transformers {transformers.__version__}'s"
    if version in table:  # the version it was generated with: exactly what the code says now
        assert table == markdown(support_table()), "regenerate: python -m swarm_client.families.support --write"
    else:  # another 🤗 release adds types; what the table says of the served and refused ones still holds
        rows = {row.model_type: row for row in support_table()}
        for line in table.splitlines():
            if line.startswith("| served") or line.startswith("| refused"):
                for model_type in (part.split("`")[1] for part in line.split(", ") if "`" in part):
                    if model_type in rows:
                        assert rows[model_type].status in line.split(" |")[0], (model_type, rows[model_type])
