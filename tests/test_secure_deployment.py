"""fedparity jobs over Flower's own TLS and SuperNode authentication (real processes).

One SuperLink and three SuperNodes on 127.0.0.1, started by ``tests/support/flower_processes.py``
with certificates and node keys made here (``tests/support/flower_tls.py``)::

    flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.crt \\
        --ssl-keyfile server.key --enable-supernode-auth ...
    flwr supernode register supernode-<i>.pub local-deployment     # each node's public key
    flower-supernode --root-certificates ca.crt --auth-supernode-private-key supernode-<i> ...
    # $FLWR_HOME/config.toml: root-certificates = ".../ca.crt" (no insecure = true)

The deployment is shared by the module (one start-up): the checks that TLS is really on and
that an unregistered key is refused, then an FPFL training (masked secure sum, distributed
noise) and a FedEvalFair test through it. docs/deployment-security.md shows the same commands.
"""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from fedparity.clients.identity import ROSTER_FILE, identity_key_file
from fedparity.mechanisms.crypto.ckks import KeyPaths, generate_keys
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from tests.support.flower_processes import (
    Deployment,
    FlwrRunError,
    local_deployment,
    run_flwr,
    supernode_statuses,
    wait_for,
    write_connection,
)
from tests.support.flower_tls import TlsMaterial, make_tls_material

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NODES = 3


@dataclass
class Secure:
    deployment: Deployment
    tls: TlsMaterial
    keys: KeyPaths
    folder: Path


def _write_identities(folder: Path, count: int) -> Path:
    """A fedparity identity key per node and the roster listing them (what ``fedparity
    identity --nodes N --out DIR`` writes)."""
    keys = {f"node-{i}": IdentityKey.generate() for i in range(count)}
    for i, key in enumerate(keys.values()):
        key.write(folder / identity_key_file(i))
    Roster({name: key.public_bytes() for name, key in keys.items()}).write(folder / ROSTER_FILE)
    return folder


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    folder = tmp_path_factory.mktemp("secure-deployment")
    tls = make_tls_material(folder / "tls", num_node_keys=NODES)
    keys = generate_keys(folder / "fef-keys")
    identities = _write_identities(tmp_path_factory.mktemp("identity"), NODES)
    # 600 users: FPFL's delta = 1/K is above the built-in fpfl-max-delta (1e-3); each node's
    # operator allows it in the node's own config. Every node holds the CKKS secret context,
    # its fedparity identity key and the roster.
    node_configs = [
        f"partition-id={i} num-partitions={NODES} fpfl-max-delta=0.002 "
        "fpfl-max-dropout-tolerance=0.45 "
        f"fef-secret-context='{keys.secret}' "
        f"identity-key='{identities / identity_key_file(i)}' "
        f"roster='{identities / ROSTER_FILE}'"
        for i in range(NODES)
    ]
    project_before = _project_status()
    with local_deployment(
        REPO,
        NODES,
        node_configs,
        folder / "flwr-home",
        tls=tls,
        node_auth=True,
        work_dir=folder / "work",
        warm=True,  # ClientApps forked from a zygote (fedparity-superexec --executor warm)
        also_allowed=[REPO / "tests" / "attack_app"],
    ) as deployment:
        yield Secure(deployment, tls, keys, folder)
        processes = deployment.processes  # the unauthorised SuperNodes included
    assert [p.name for p in processes if p.alive()] == []  # nothing left running
    # Runs leave the project folder as they found it: no state, keys or bundles in it.
    assert _project_status() == project_before


def _project_status() -> str | None:
    """``git status --porcelain --ignored`` of the project (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    # caches written by the test run itself (bytecode, pytest's) are not run state
    return "\n".join(
        line
        for line in done.stdout.splitlines()
        if "__pycache__" not in line and ".pytest_cache" not in line and ".hypothesis" not in line
    )


def _get(url: str, context: ssl.SSLContext | None = None) -> int:
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        return int(response.status)


def test_the_superlink_serves_tls_only(secure: Secure) -> None:
    deployment, tls = secure.deployment, secure.tls
    port = deployment.superlink.port
    assert "--insecure" not in deployment.superlink.cmd
    assert "--enable-supernode-auth" in deployment.superlink.cmd
    assert "Uvicorn running on https://127.0.0.1" in deployment.superlink.log_text()
    for node in deployment.supernodes:
        assert "--insecure" not in node.cmd and "--root-certificates" in node.cmd

    # It presents the server certificate made here, which verifies against our CA ...
    presented = ssl.get_server_certificate(("127.0.0.1", port))
    assert ssl.PEM_cert_to_DER_cert(presented) == ssl.PEM_cert_to_DER_cert(
        tls.server_cert.read_text()
    )
    verified = ssl.create_default_context(cafile=str(tls.ca_cert))
    assert _get(f"https://127.0.0.1:{port}/health", verified) == 200
    # ... and not against the system's trust store,
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(f"https://127.0.0.1:{port}/health", ssl.create_default_context())
    # and a plain-HTTP client gets no answer at all.
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        _get(f"http://127.0.0.1:{port}/health")

    # The flwr CLI with an `insecure = true` connection to the same address is refused; the
    # deployment's own connection (root-certificates) lists exactly the three nodes, online.
    flwr_home = deployment.flwr_home
    config = tomllib.loads((flwr_home / "config.toml").read_text(encoding="utf-8"))
    assert config["superlink"][deployment.federation] == {
        "address": deployment.address,
        "root-certificates": str(tls.ca_cert),
    }
    write_connection(flwr_home, "plain-http", deployment.address)
    with pytest.raises(FlwrRunError, match="unavailable"):
        supernode_statuses("plain-http", flwr_home)
    statuses = deployment.node_statuses()
    assert statuses == {node_id: "online" for node_id in deployment.node_ids}


def test_only_registered_keys_can_join(secure: Secure) -> None:
    deployment = secure.deployment
    # A SuperNode with a fresh key the SuperLink never registered (same TLS options).
    intruder = deployment.start_unauthorized_supernode(f"partition-id=0 num-partitions={NODES}")
    wait_for(lambda: not intruder.alive(), 60, what="the unauthorised SuperNode to exit")
    assert intruder.popen.returncode != 0
    log = intruder.log_text()
    assert "Exit Code: 305" in log and "[code: 2004] Failed to activate SuperNode." in log
    assert "SuperNode ID" not in log
    # The SuperLink refused it (its log names the key), and never lists it.
    public_key = _pem_public_key(deployment.work_dir / "node-keys" / f"{intruder.name}.pub")
    refusals = [
        line
        for line in deployment.superlink.log_text().splitlines()
        if "/v1/fleet/activate-node][ApiError:2004]" in line
    ]
    assert any(public_key in line.replace("\\n", "\n") for line in refusals)
    # Nor may a SuperNode without a key register itself.
    keyless = deployment.start_unauthorized_supernode(
        f"partition-id=1 num-partitions={NODES}", without_key=True
    )
    wait_for(lambda: not keyless.alive(), 60, what="the keyless SuperNode to exit")
    assert "--auth-supernode-private-key" not in keyless.cmd
    assert "[code: 2001] SuperNode authentication is enabled." in keyless.log_text()
    assert "SuperNode ID" not in keyless.log_text()
    statuses = deployment.node_statuses()
    assert statuses == {node_id: "online" for node_id in deployment.node_ids}
    # A second registration of an authorised node's key is refused as well.
    with pytest.raises(FlwrRunError, match="already in use"):
        deployment.register_node_key(deployment.node_keys[0])


def test_fpfl_over_tls_with_node_auth(secure: Secure) -> None:
    folder = secure.folder / "fpfl"
    run = secure.deployment.run(
        {
            "task": "fpfl",
            "dataset": "synthetic",
            "users-per-node": 200,
            "fpfl-cohort-size": 150,
            "fpfl-algorithm": "fpfl",
            "fpfl-rounds": 2,
            "fpfl-secure-sum": "masking",
            "fpfl-noise": "distributed",
            "min-nodes": NODES,
            "reply-timeout": 60.0,
            "output-dir": str(folder),
        },
        timeout=240,
    )
    assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((folder / "results.json").read_text())
    assert results["status"] == "completed" and results["rounds_lost"] == 0
    assert results["population"] == {"users": NODES * 200, "nodes": NODES, "setup_failed": []}
    assert [entry["replied"] for entry in results["history"]] == [NODES] * 2
    privacy = results["privacy"]
    assert privacy["secure_sum"] == "masking" and privacy["noise"] == "distributed"
    assert results["private"] is True and results["noise_multiplier"] > 0
    assert results["epsilon"] is not None and results["epsilon"] <= 2.0 + 1e-9


def test_fedevalfair_over_tls_with_node_auth(secure: Secure) -> None:
    folder = secure.folder / "fedevalfair"
    run = secure.deployment.run(
        {
            "task": "fedevalfair",
            "fef-public-context": str(secure.keys.public),
            "users-per-node": 1000,
            "num-server-rounds": 0,
            "min-nodes": NODES,
            "reply-timeout": 60.0,
            "output-dir": str(folder),
        },
        timeout=240,
    )
    assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((folder / "results.json").read_text())
    assert results["num_nodes"] == NODES
    assert results["server_context_has_secret_key"] is False
    outcome = results["fedevalfair"]
    assert outcome["error"] is None and outcome["rejected_replies"] == [], outcome
    assert set(outcome["round_participants"][0]) == set(secure.deployment.node_ids)


def test_an_active_server_is_refused_by_the_nodes(secure: Secure) -> None:
    """tests/attack_app's ServerApp against the real ClientApp on these nodes, whose node
    config gives each its fedparity identity key and the roster: an invented peer (a node
    missing from the roster) and a substituted key are refused before the key table is
    pinned; the honest table is pinned and an honest round is recovered; the same round sent
    again and a later key change are refused. Each refusal reaches the server as a fixed
    sentence."""
    deployment = secure.deployment
    folder = secure.folder / "attacks"
    report = _attack(secure, folder, {"seed": 1})
    nodes = {str(node) for node in deployment.node_ids}
    target = str(min(deployment.node_ids))

    def refused(attack: str, rule: str, expected: set[str]) -> None:
        answers = report[attack]
        assert set(answers) == expected, (attack, answers)
        assert all(rule in reason for reason in answers.values()), (attack, answers)

    refused("node missing from the roster", "not on this node's roster", nodes)
    refused("substituted key", "not on this node's roster", nodes - {target})
    assert report["honest key table"] == dict.fromkeys(nodes, "accepted")
    assert report["honest round"] == {"total": "recovered"}
    refused("replayed round", "masked already; refusing a replay", nodes)
    refused("key change after pinning", "pinned for this run; refusing a change", nodes - {target})


def _attack(secure: Secure, folder: Path, run_config: dict) -> dict:
    """Run tests/attack_app against the deployment; its report."""
    deployment = secure.deployment
    run = run_flwr(
        REPO / "tests" / "attack_app",
        deployment.federation,
        {"output-dir": str(folder), **run_config},
        deployment.flwr_home,
        timeout=240,
    )
    assert run.status == "finished:completed", run.output[-3000:]
    return json.loads((folder / "attacks.json").read_text())


def test_a_split_view_on_the_population_size_is_refused_by_every_node(secure: Secure) -> None:
    """Review 2026-11-26 C1 through real SuperNodes with a roster: the first node is proposed
    the true K, the others K = 10^7 (a sigma half as large). Each accepts its own view at setup
    (both are within its policy), but every masking key is signed together with the digest of
    the parameters its node accepted: every node refuses the key table of its own view, which
    holds a key signed for the other view, so no node pins anything and no round is masked."""
    report = _attack(secure, secure.folder / "attack-parameters", {"seed": 2})
    nodes = {str(node) for node in secure.deployment.node_ids}
    assert report["setup"] == dict.fromkeys(nodes, "accepted")
    assert report["sigma"]["inflated"] < report["sigma"]["true"]
    refusals = report["split key tables"]
    assert set(refusals) == nodes, refusals
    assert all("not signed by its node" in reason for reason in refusals.values()), refusals


def test_split_views_of_the_survivors_open_no_vector(secure: Secure) -> None:
    """Review 2026-11-26 H1 through real SuperNodes (rho = 0.45, the node configs allow it):
    node a is told "b survived, c dropped", b "c survived, a dropped", c "nobody dropped".
    Node b attests a's view first and refuses to attest a second one, so b's view is attested
    by c alone and b refuses to reveal its pair seed with a; the server holds 2 of the t = 3
    shares of a's self-mask and not every pair seed of a: a's vector stays masked."""
    report = _attack(
        secure,
        secure.folder / "attack-survivors",
        {"seed": 3, "fpfl-dropout-tolerance": 0.45},
    )
    a, b, c = (str(node) for node in sorted(secure.deployment.node_ids))
    assert report["setup failed"] == []
    assert report["thresholds"] == dict.fromkeys((a, b, c), 3)
    assert report["attest a's view"] == {a: "accepted", b: "accepted"}
    assert report["attest b's view"][c] == "accepted"
    assert "attested another view" in report["attest b's view"][b]
    assert report["reveal"][a] == "accepted" and report["reveal"][c] == "accepted"
    assert "attested another view" in report["reveal"][b]
    held = report["what the server holds of a"]
    assert held["shares"] < held["threshold"]
    assert held["pair seeds"] == [f"{a}-{c}"]  # the seed with b was never revealed


def _pem_public_key(openssh_public_key: Path) -> str:
    """The key as the SuperLink logs it (SubjectPublicKeyInfo PEM)."""
    key = serialization.load_ssh_public_key(openssh_public_key.read_bytes())
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")
