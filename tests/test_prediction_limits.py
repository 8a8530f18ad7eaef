"""An 8 MiB ``prediction`` (issue 35, the audit's attacks/prediction_hol.py): refused on the count of its
beginning, as a prompt is, instead of being tokenized whole on the one tokenize thread — where every other
request's prompt waited behind it (a 4-token chat sent 0.5 s later took 93 s).
"""

from __future__ import annotations

import json
import threading
import time

from gateway.decode.prompting import PromptRules
from tests.gateway_fixtures import Gateway, shared_gateway

SMALL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
#: the audit's payload: just under the default 8 MiB body limit
PREDICTION = {**SMALL, "prediction": {"type": "content", "content": "abc " * (8 * 2**20 // 4 - 200)}}


def _timed_post(gw: Gateway, raw: bytes, out: dict[str, object]) -> None:
    started = time.perf_counter()
    with gw.http() as http:
        r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    out.update(status=r.status_code, body=r.json(), seconds=time.perf_counter() - started)


def test_8_mib_prediction_is_a_quick_400_and_another_chat_is_answered_meanwhile() -> None:
    """Figures are printed (``-s``); the bounds are generous (other suites share the machine): measured
    ~0.3 s for the 400 and ~0.1 s for the small chat, against 93 s before."""
    gw = shared_gateway()
    attack: dict[str, object] = {}
    victim: dict[str, object] = {}
    thread = threading.Thread(target=_timed_post, args=(gw, json.dumps(PREDICTION).encode(), attack))
    thread.start()
    time.sleep(0.5)
    _timed_post(gw, json.dumps(SMALL).encode(), victim)
    thread.join(60)
    print(f"\n8 MiB prediction: {attack['status']} in {attack['seconds']:.2f} s; chat sent 0.5 s later: "
          f"{victim['status']} in {victim['seconds']:.2f} s")  # fmt: skip
    assert attack["status"] == 400 and victim["status"] == 200
    error = attack["body"]["error"]  # type: ignore[index]
    assert error["param"] == "prediction" and "context window" in error["message"]
    assert attack["seconds"] < 10 and victim["seconds"] < 10


def test_prediction_within_the_window_is_tokenized_whole() -> None:
    """The precheck changes nothing for a prediction that fits: its ids are the tokenizer's own."""
    gw = shared_gateway()
    rules: PromptRules = gw.server.app.state.engine
    text = "The swarm serves blocks. " * 20
    ids = rules.tokenize._executor.submit(rules.prediction_ids_sync, text).result(30)
    assert ids == rules.tokenizer(text, add_special_tokens=False)["input_ids"]
