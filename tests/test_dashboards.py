"""
conf/grafana/iop.json and conf/prometheus/alerts.yml against real
daemons: every metric either file names exists on a live scrape of an
Edge or a Node (after a little traffic, for the metrics that appear only
with it), and both files have the shape Grafana and Prometheus load.
"""

import json
import os
import re
import signal
import threading
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.daemons import echo_node, free_port, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "conf", "grafana", "iop.json")
ALERTS = os.path.join(ROOT, "conf", "prometheus", "alerts.yml")
METRIC = re.compile(r"\biop_[a-z0-9_]+")


def dashboard_queries():
    dashboard = json.load(open(DASHBOARD))
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return queries


def alert_rules():
    return [rule for group in yaml.safe_load(open(ALERTS))["groups"] for rule in group["rules"]]


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_files_have_their_shape():
    """
    The dashboard's panels have unique ids and each query names a metric;
    each alert has a name, an expression, a severity and a summary.
    """
    dashboard = json.load(open(DASHBOARD))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(METRIC.search(q) for q in dashboard_queries())
    rules = alert_rules()
    assert {"IopNodeDown", "IopProviderEjected", "IopQueueSaturation", "IopLeaseLeak"} <= {r["alert"] for r in rules}
    for rule in rules:
        assert METRIC.search(rule["expr"]), rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]


def test_every_metric_exists_on_a_live_scrape(launch):
    """
    After a completion, a run cut by a killed Node and the Node's own
    scrape, every metric the dashboard and the alerts use is one an Edge
    or a Node serves.
    """
    edge = launch.edge(
        {
            "nodes": [echo_node("node-1", "tok-1", delay_ms=100)],
            "model_groups": [{"name": "echo-model", "providers": [{"node": "node-1", "provider": "echo"}]}],
        }
    )
    node_metrics = free_port()
    node = launch.node(edge.node_port, "tok-1", extra={"metrics": f"tcp:{node_metrics}:interface=127.0.0.1"})
    edge.wait_connected("node-1")

    body = {"model": "echo-model", "messages": [{"role": "user", "content": "one two three"}]}
    assert edge.json("POST", "/v1/chat/completions", body)[0] == 200
    node_names = wait_for(lambda: scrape(f"http://127.0.0.1:{node_metrics}/metrics"), what="the Node's /metrics")

    # A run cut by its Node's death: a failure reason and a disconnect cause.
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (edge.run_events({"model": "echo-model", "input": "a b c d e f g h i j"}), done.set()),
        daemon=True,
    )
    thread.start()
    wait_for(lambda: edge.status()["nodes"][0]["in_flight"] == 1, what="the run in flight")
    node.stop(signal.SIGKILL)
    thread.join(timeout=30)
    assert done.is_set()
    edge.wait_connected("node-1", connected=False)

    names = scrape(edge.base_url + "/metrics") | node_names
    used = {name for query in dashboard_queries() for name in METRIC.findall(query)}
    used |= {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}
    missing = sorted(used - names)
    assert not missing, f"named in the dashboard or alerts but not served: {missing}"
    assert {n for n in used if n.startswith("iop_node_")}, "the dashboard shows the Nodes' own metrics too"
