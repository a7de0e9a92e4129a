"""The ledger endpoint's cache of TokenReview verdicts: by the token's hash, for a short time, and
never past the token's own expiry."""

from __future__ import annotations

import base64
import json
import time

from kubernetes import client

from retex.kube.identity import WorkerIdentities, WorkerIdentity

POD = WorkerIdentity(namespace="shop", pod="order-x-2-abcde", service_account="retex-worker",
                     job_name="order-x-2", task_uid="uid-1", epoch=2)


class CountingReviews(WorkerIdentities):
    """The API server's side faked: every token is a valid one of POD; reviews are counted."""

    def __init__(self):
        super().__init__(client.ApiClient())
        self.reviews = 0

    def _review(self, token: str) -> WorkerIdentity:
        self.reviews += 1
        return POD


def jwt(**claims) -> str:
    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.signature"


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
