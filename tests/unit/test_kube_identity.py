"""The ledger endpoint's cache of TokenReview verdicts: by the token's hash, for a short time, and
never past the token's own expiry; refusals kept apart, so that no flood of them evicts a worker."""

from __future__ import annotations

import base64
import json
import time

import pytest
from kubernetes import client

from retex.kube.identity import NotAWorker, WorkerIdentities, WorkerIdentity

POD = WorkerIdentity(namespace="shop", pod="order-x-2-abcde", service_account="retex-worker",
                     job_name="order-x-2", task_uid="uid-1", epoch=2)


class CountingReviews(WorkerIdentities):
    """The API server's side faked: every token is a valid one of POD but those with a `forged`
    claim; reviews are counted."""

    def __init__(self):
        super().__init__(client.ApiClient())
        self.reviews = 0

    def _review(self, token: str) -> WorkerIdentity:
        self.reviews += 1
        if "forged" in json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "==")):
            raise NotAWorker("token not accepted for audience retex-ledger: unauthenticated")
        return POD


def jwt(aud=("retex-ledger",), **claims) -> str:
    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims | {'aud': list(aud)})}.signature"


def test_a_reviewed_token_is_not_reviewed_again_within_the_cache_time():
    identities = CountingReviews()
    token = jwt(exp=time.time() + 3600)
    assert identities.resolve(token) == identities.resolve(token) == POD
    assert identities.reviews == 1


def test_a_verdict_is_never_kept_past_the_tokens_own_expiry():
    # A token the API server accepted a moment before it expired must not act on the cached
    # verdict after that: it is reviewed again (and the API server refuses it).
    identities = CountingReviews()
    expired = jwt(exp=time.time() - 1)
    identities.resolve(expired)
    identities.resolve(expired)
    assert identities.reviews == 2


def test_a_flood_of_refused_tokens_never_evicts_a_workers_verdict():
    identities = CountingReviews()
    worker = jwt(exp=time.time() + 3600)
    identities.resolve(worker)
    for n in range(5000):  # more than the cache holds
        with pytest.raises(NotAWorker):
            identities.resolve(jwt(exp=time.time() + 3600, forged=n))
    reviews = identities.reviews
    assert identities.resolve(worker) == POD
    assert identities.reviews == reviews, "the worker's token was reviewed again"


@pytest.mark.parametrize("token", ["garbage", "a.b.c", jwt(aud=("https://kubernetes.default.svc",), exp=time.time() + 60)])
def test_a_token_that_cannot_be_a_ledger_token_is_refused_without_a_review(token):
    identities = CountingReviews()
    with pytest.raises(NotAWorker):
        identities.resolve(token)
    assert identities.reviews == 0
