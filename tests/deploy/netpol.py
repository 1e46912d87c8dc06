"""Kubernetes NetworkPolicy semantics (networking.k8s.io/v1, as the API reference states them),
for asking of deploy/'s policies who may open a connection to whom.

A connection from A to B on a port is allowed when A's namespace lets it out and B's lets it in:
in each direction, a pod that no policy of its namespace selects (for that policy type) is open;
a selected pod allows exactly what the union of the selecting policies' rules allows. A rule
matches when one of its peers matches the other end (no peers: everyone) and one of its ports
matches (no ports: every port). A peer's podSelector alone means pods of the policy's own
namespace; with a namespaceSelector, pods of the selected namespaces; an ipBlock, addresses (here:
endpoints outside the cluster). Only matchLabels selectors and numeric ports are modelled; the
functions refuse anything else rather than guess."""

import ipaddress
from dataclasses import dataclass, field


@dataclass
class Endpoint:
    """A pod (namespace and labels) or, with namespace None, an address outside the cluster."""

    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.0.0.1"


def namespace_labels(name: str, namespaces: dict[str, dict[str, str]] | None = None) -> dict:
    """A namespace's labels: those given for it in `namespaces`, and the one every namespace
    carries, its name."""
    return {**(namespaces or {}).get(name, {}), "kubernetes.io/metadata.name": name}


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True  # {} selects everything
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"only matchLabels is modelled: {selector}")
    return selector.get("matchLabels", {}).items() <= labels.items()


def peer_matches(peer: dict, policy_namespace: str, other: Endpoint,
                 namespaces: dict | None = None) -> bool:  # fmt: skip
    if "ipBlock" in peer:
        if other.namespace is not None:
            return False  # pod addresses are not modelled as ipBlock matches
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        labels = namespace_labels(other.namespace, namespaces)
        namespace_ok = selects(peer["namespaceSelector"], labels)
    else:
        namespace_ok = other.namespace == policy_namespace
    return namespace_ok and selects(peer.get("podSelector"), other.labels)


def port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if not isinstance(entry.get("port", 0), int):
            raise ValueError(f"named ports are not modelled: {entry}")
        if entry.get("protocol", "TCP") == protocol and entry.get("port") in (None, port):
            return True
    return False


def policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" not in spec:
        raise ValueError(f"{policy['metadata']['name']}: write policyTypes out")
    return spec["policyTypes"]


def lets(policies: list[dict], pod: Endpoint, other: Endpoint, port: int, protocol: str,
         direction: str, namespaces: dict | None = None) -> bool:  # fmt: skip
    """Whether `pod`'s policies let the connection with `other` in ("Ingress") or out
    ("Egress"); `policies` carry metadata.namespace; `namespaces`: labels of namespaces."""
    if pod.namespace is None:
        return True  # an address outside the cluster has no policies
    applicable = [
        p for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in policy_types(p)
        and selects(p["spec"]["podSelector"], pod.labels)
    ]  # fmt: skip
    if not applicable:
        return True
    rules, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in applicable:
        for rule in policy["spec"].get(rules, []):
            matched = not rule.get(peers) or any(
                peer_matches(peer, policy["metadata"]["namespace"], other, namespaces)
                for peer in rule[peers]
            )
            if matched and port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def can_connect(policies: list[dict], src: Endpoint, dst: Endpoint, port: int,
                protocol: str = "TCP", namespaces: dict | None = None) -> bool:  # fmt: skip
    """Whether src may open a connection to dst's port: src's policies let it out and dst's let
    it in. `namespaces`: namespace name → its labels (beyond its name)."""
    return lets(policies, src, dst, port, protocol, "Egress", namespaces) and lets(
        policies, dst, src, port, protocol, "Ingress", namespaces
    )
