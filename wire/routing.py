"""The gateway's routing policies, by the names its config (`models.M.routing`) accepts: shared
by the gateway, which implements them (gateway/routing.py), and the fleet experiment, which
flips between them and must reject a name before it starts replicas for minutes."""

ROUTING_POLICIES = ("round-robin", "least-outstanding", "prefix-affinity")
