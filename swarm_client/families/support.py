"""What the swarm serves of every causal-LM model type the installed 🤗 Transformers knows, generated from
the code: served (by which family), refused (a recurrent state per session: ``families/recurrent.py``) or
not served yet (no family). docs/families.md holds the table this writes; tests/test_model_support.py
checks it against the code.

    python -m swarm_client.families.support            # print the Markdown
    python -m swarm_client.families.support --write    # replace the table in docs/families.md
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from swarm_client.families import _FAMILIES
from swarm_client.families.recurrent import recurrent_reason

__all__ = ["BEGIN", "END", "Support", "markdown", "support_table"]

BEGIN = "<!-- model-types:begin (python -m swarm_client.families.support --write) -->"
END = "<!-- model-types:end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "families.md"


@dataclass(frozen=True)
class Support:
    model_type: str
    #: "served", "refused" or "not yet"
    status: str
    #: the family that serves it, or why it is refused
    detail: str = ""


def _config(model_type: str) -> object | None:
    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # a config class that needs arguments to be made
        return None


def support_table() -> list[Support]:
    """Every model type of 🤗's causal-LM mapping, with what the swarm does with it."""
    families = {t: f.name for f in _FAMILIES for t in f.model_types}
    rows = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in families:
            rows.append(Support(model_type, "served", families[model_type]))
            continue
        config = _config(model_type)
        reason = recurrent_reason(config) if config is not None else None
        rows.append(Support(model_type, "refused", reason) if reason else Support(model_type, "not yet"))
    return rows


def markdown(rows: list[Support]) -> str:
    served = [r for r in rows if r.status == "served"]
    refused = [r for r in rows if r.status == "refused"]
    later = [r for r in rows if r.status == "not yet"]
    lines = [
        BEGIN,
        f"Of the {len(rows)} model types of 🤗 Transformers {transformers.__version__}'s causal-LM mapping:",
        "",
        "| status | count | model types |",
        "|---|---|---|",
        f"| served | {len(served)} | " + ", ".join(f"`{r.model_type}` ({r.detail})" for r in served) + " |",
        f"| refused: a recurrent state per session | {len(refused)} | "
        + ", ".join(f"`{r.model_type}` ({r.detail})" for r in refused)
        + " |",
        f"| not served yet (no family) | {len(later)} | " + ", ".join(f"`{r.model_type}`" for r in later) + " |",
        END,
    ]
    return "\n".join(lines)


def documented(text: str) -> str | None:
    """The generated table inside ``text`` (docs/families.md), None when it has none."""
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    return match.group(0) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/families.md")
    args = parser.parse_args()
    rows = support_table()
    table = markdown(rows)
    if not args.write:
        print(table)
        return
    text = DOC.read_text()
    old = documented(text)
    if old is None:
        raise SystemExit(f"{DOC} has no {BEGIN!r} … {END!r} section to replace")
    DOC.write_text(text.replace(old, table))
    print(f"wrote the table of {len(rows)} model types into {DOC}")


if __name__ == "__main__":
    main()
