"""The reward-service client against a local HTTP server the test starts: batched POSTs, retries, timeouts,
answers of the wrong shape, and the scorer adding the service's scores."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridrl.config import RewardConfig
from hybridrl.rewards.http import HttpRewardClient


class Service:
    """A reward service: scores each item by ``len(response) == len(ground_truth)``; ``behaviour`` makes the
    next requests fail (``fail`` N: HTTP 503; ``slow``: sleep; ``bad``: the wrong number of scores ...)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.plan: list[str] = []  # what the next requests do, in order; then "ok"
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                action = service.plan.pop(0) if service.plan else "ok"
                if action == "slow":
                    time.sleep(1.5)
                if action == "fail":
                    return self._send(503, b"busy")
                if action == "reject":
                    return self._send(400, b"bad request")
                items = body["items"]
                scores = [float(len(it["response"]) == len(str(it.get("ground_truth", "")))) for it in items]
                if action == "bad":
                    scores = scores[:-1]
                if action == "null":
                    scores[0] = None
                if action == "text":
                    return self._send(200, b"not json")
                self._send(200, json.dumps({"scores": scores}).encode())

            def _send(self, code, payload):
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = Service()
    yield s
    s.close()


def items(n):
    return [("p", "ab" if i % 2 else "abc", {"ground_truth": "xy", "data_source": "s"}) for i in range(n)]


def client(url, **kw):
    return HttpRewardClient(url, **{"batch_size": 4, "retries": 2, "timeout_s": 1.0, "backoff_s": 0.01, **kw})


def test_batches_are_posted_with_the_fields_and_scores_come_back_in_order(service):
    outcomes = client(service.url).run(items(10))
    assert [o.score for o in outcomes] == [0.0, 1.0] * 5 and not any(o.failed for o in outcomes)
    assert sorted(len(r["items"]) for r in service.requests) == [2, 4, 4]
    first = service.requests[0]["items"][0]
    assert first == {"prompt": "p", "response": "abc", "ground_truth": "xy", "data_source": "s"}


def test_server_errors_are_retried(service):
    service.plan = ["fail", "fail"]
    c = client(service.url, batch_size=100)
    assert [o.score for o in c.run(items(4))] == [0.0, 1.0, 0.0, 1.0]
    assert c.requests == 3


def test_a_service_that_keeps_failing_scores_zero_as_errors(service):
    service.plan = ["fail"] * 3
    outcomes = client(service.url, batch_size=100).run(items(3))
    assert all(o.failed and not o.timeout for o in outcomes)
    assert outcomes[0].error == "roles.reward.url answered HTTP 503 busy after 3 tries"


def test_a_slow_service_times_out(service):
    service.plan = ["slow", "slow"]
    outcomes = client(service.url, batch_size=100, retries=1).run(items(2))
    assert all(o.timeout for o in outcomes)
    assert "did not answer within 1s (roles.reward.http.timeout_s) after 2 tries" in outcomes[0].error


def test_a_slow_answer_is_retried_and_then_succeeds(service):
    service.plan = ["slow"]
    outcomes = client(service.url, batch_size=100).run(items(2))
    assert [o.score for o in outcomes] == [0.0, 1.0]


def test_client_errors_are_not_retried(service):
    service.plan = ["reject"]
    c = client(service.url, batch_size=100)
    outcomes = c.run(items(2))
    assert c.requests == 1 and outcomes[0].error == "roles.reward.url answered HTTP 400 bad request"


@pytest.mark.parametrize("action, error", [
    ("bad", "answered 1 scores for 2 items"),
    ("text", "answered something that is not JSON"),
])
def test_answers_of_the_wrong_shape_fail_the_batch(service, action, error):
    service.plan = [action]
    outcomes = client(service.url, batch_size=100).run(items(2))
    assert all(o.failed for o in outcomes) and error in outcomes[0].error


def test_a_null_score_fails_only_its_item(service):
    service.plan = ["null"]
    outcomes = client(service.url, batch_size=100).run(items(2))
    assert outcomes[0].failed and not outcomes[1].failed and outcomes[1].score == 1.0


def test_an_unreachable_service_is_an_error():
    outcomes = client("http://127.0.0.1:9/score", retries=0).run(items(1))
    assert "cannot be reached" in outcomes[0].error


def test_the_scorer_adds_the_service_to_the_rule_reward(service):
    from test_reward_runner import _batch, _spec

    from hybridrl.model.tokenizer import build_char_tokenizer
    from hybridrl.rewards.scorer import RewardScorer

    cfg = RewardConfig(fn="_reward_helpers:flaky", runner="inline", url=service.url, http={"coef": 2.0})
    scorer = RewardScorer(build_char_tokenizer(), _spec(fn="_reward_helpers:flaky"), reward_cfg=cfg)
    meta = [{"ground_truth": "xy"}, {"ground_truth": "xyz"}]
    scored = scorer(_batch(["ab", "ab"], meta))
    assert scored.parts["rule"].tolist() == [2.0, 2.0] and scored.parts["http"].tolist() == [1.0, 0.0]
    assert scored.scores.tolist() == [4.0, 2.0]


def test_urls_are_validated():
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        RewardConfig(url="localhost:8000")
    assert RewardConfig(fn=None, url="http://h/score").url == "http://h/score"  # a service alone is a reward
