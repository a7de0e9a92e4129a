"""What a Task may ask for, and what its worker may touch, on the rig's real API server (issue 14,
items 3, 4 and 7): a namespace's TaskPolicy decides the images, ServiceAccounts, placement, step
kinds and http destinations of its Tasks; a worker pod may update only its own task's Lease; an
object squatting on the name of a task's Lease or Job ends the task instead of being adopted.
"""

from __future__ import annotations

import json
from datetime import datetime


from e2e.system import task_manifest, wait_for
from retex.kube.objects import lease_name
from retex.operator.admission import admission_for


def task(system, name) -> dict:
    out = system.kubectl("get", "task", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def condition(system, name, kind) -> dict:
    conditions = (task(system, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def admitted_while_the_operator_is_down(system, name, steps) -> str:
    """A Task in the ledger with its first dispatch waiting, its uid known before any relay ran."""
    system.kubectl("create", "-f", "-", input=task_manifest(name, steps))
    meta = task(system, name)["metadata"]
    system.ledger.admit(admission_for(
        uid=meta["uid"], namespace=meta["namespace"], name=name, spec=task(system, name)["spec"],
        submitted_at=datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))))
    return meta["uid"]


def test_a_lease_name_held_by_a_lease_not_of_this_task_ends_the_task_and_is_left_alone(retex):
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "squatted", [{"name": "say", "exec": {"command": ["true"]}}])
    name = lease_name("squatted", uid)
    # Someone else's Lease under the name the operator will give this task's: holding it, renewed
    # by its owner. Adopting it would hand the task's liveness to whoever renews it.
    foreign = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
               "spec": {"holderIdentity": "someone-else:1", "leaseDurationSeconds": 3600}}
    retex.kubectl("create", "-f", "-", input=json.dumps(foreign))
    retex.operator.start()
    wait_for(lambda: (task(retex, "squatted").get("status") or {}).get("phase") == "Failed", timeout=60,
             what="squatted Failed")
    failed = condition(retex, "squatted", "Failed")
    assert failed["reason"] == "JobRejected", failed
    assert f'Lease "{name}" already exists and is not owned by this Task' in failed["message"], failed
    assert not retex.kubectl("get", "jobs", "-o", "name").stdout.strip()  # no worker was started on it
    lease = json.loads(retex.kubectl("get", "lease", name, "-o", "json").stdout)
    assert not lease["metadata"].get("ownerReferences") and lease["spec"]["holderIdentity"] == "someone-else:1"
