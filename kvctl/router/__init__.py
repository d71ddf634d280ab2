"""``kvctl router``: picks the node for a request from the fleet index, the tiers and the links.

``score`` is the decision (a pure function of the index's answer, the topology and the load),
``policies`` the baselines it is compared with, ``topology`` the fleet's nodes and the links
between DCs, ``load`` the queued work per node, ``service`` the HTTP app.
"""
