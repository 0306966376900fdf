"""PD disaggregation across nodes, on one machine: a Ray cluster of a head (no CPUs: Serve's
controller, HTTP proxy and the ingress) and two worker nodes of one CPU each, with the app
deployed from deploy/serve-pd.yaml as `serve deploy` applies a config. A prefill and a decode
replica of one CPU each cannot share a node, so the KV cache crosses nodes on every request:
greedy output still equals the unified engine's, a conversation's next turn moves only the pages
the decode replica does not hold, and both pools end idle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from tests.pd_utils import MAX_TOKENS, PD_ARGS, PROMPTS, unified_reference, wait_idle
from tests.serve_utils import free_port
from tests.test_multinode import deploy, keeping_current_cluster_file, wait_for

pytestmark = pytest.mark.slow  # starts a multi-node Ray cluster and a live Serve app

REPO = Path(__file__).resolve().parents[1]
APP = "radixserve"
GREEDY = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
POOL_NODES: dict[str, str] = {}  # pool -> the id of the node that advertises its resource


def serve_pd_config(port: int) -> dict:
    """deploy/serve-pd.yaml for this cluster: its port, small one-CPU prefill and decode replicas."""
    config = yaml.safe_load((REPO / "deploy" / "serve-pd.yaml").read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"].update(PD_ARGS, port=port, kv_transfer="gloo")
    return config


def replica_nodes() -> dict[str, str]:
    """Alive engine deployments' replicas -> the node each runs on, by deployment name."""
    from ray._private.state import actors

    nodes: dict[str, str] = {}
    for a in actors().values():
        name = a.get("Name", "")
        for deployment in ("PrefillReplica", "DecodeReplica"):
            if a["State"] == "ALIVE" and name.startswith(f"SERVE_REPLICA::{APP}#{deployment}#"):
                nodes[deployment] = a["Address"]["NodeID"]
    return nodes


@pytest.fixture(scope="module")
def reference():
    return unified_reference(PROMPTS)  # before Ray starts: the engine gets the CPUs to itself


@pytest.fixture(scope="module")
def http(reference) -> Iterator[httpx.Client]:
    from ray.cluster_utils import Cluster

    with keeping_current_cluster_file():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    # Each worker advertises one pool's resource, as deploy/cluster-aws.yaml's node types do:
    # serve-pd.yaml's pools ask for them.
    pool_nodes = {
        pool: cluster.add_node(num_cpus=1, resources={f"{pool}_pool": 1}) for pool in ("prefill", "decode")
    }
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    POOL_NODES.update({pool: node.node_id for pool, node in pool_nodes.items()})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        deploy(serve_pd_config(port))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:

            def ready() -> bool:
                try:
                    return len(client.get("/get_server_info").json()["replicas"]) == 2
                except (httpx.HTTPError, KeyError, ValueError):
                    return False

            wait_for("a prefill and a decode replica", ready, timeout_s=400)
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()
        with keeping_current_cluster_file():  # shutdown deletes the record, whoever's it is
            cluster.shutdown()


def test_prefill_and_decode_run_on_different_nodes(http):
    nodes = replica_nodes()
    # Each pool on the node that advertises its resource.
    assert nodes == {"PrefillReplica": POOL_NODES["prefill"], "DecodeReplica": POOL_NODES["decode"]}
    wait_idle(http)


def test_greedy_output_across_nodes_equals_unified(http, reference):
    ids, expected, _ = reference
    for prompt_ids, ref in zip(ids, expected):
        out = http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY}).json()
        assert out["output_ids"] == ref["output_ids"]
        assert out["text"] == ref["text"]
    stats = {r["role"]: r for r in wait_idle(http)}
    assert stats["prefill"]["pd_bytes_sent_total"] > 0
    assert stats["decode"]["pd_bytes_received_total"] == stats["prefill"]["pd_bytes_sent_total"]


def test_a_follow_up_turn_moves_only_the_new_pages(http):
    first = [{"role": "user", "content": "Name three colours of the rainbow."}]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r1 = http.post("/v1/chat/completions", json={"messages": first, **body})
    assert r1.status_code == 200, r1.text
    before = {r["role"]: r for r in wait_idle(http)}
    answer = r1.json()["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And two more?"}]
    r2 = http.post("/v1/chat/completions", json={"messages": second, **body})
    assert r2.status_code == 200, r2.text
    after = {r["role"]: r for r in wait_idle(http)}
    moved = after["decode"]["pd_bytes_received_total"] - before["decode"]["pd_bytes_received_total"]
    saved = after["decode"]["pd_bytes_saved_total"] - before["decode"]["pd_bytes_saved_total"]
    assert moved > 0 and saved > 0  # the first turn's pages stayed on the decode replica
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
