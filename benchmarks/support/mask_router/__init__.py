"""The router as it was before the index kept holder sets: a W-bit worker mask per cached key
(``index.PrefixIndex``, ``worker_masks``) and a policy that costs every worker on each decision
(``policy.RoutingPolicy``). Kept verbatim (imports aside) as the baseline ``benchmarks/router_scale.py``
runs side by side with ``engine.routing``; nothing in the product imports it.
"""
