"""kvpilot-gateway: one OpenAI endpoint in front of every ModelDeployment (architecture §3.7).

The proxy core at the top (`proxy`, `exchange`, `upstream`, `bodies`, `usage`, `config`, `cli`);
rooms per feature, each split the same way (pure rules, a store, the policy the proxy runs, its
config): routing/ (which replica: affinity, load, picking, holding while waking, cascades),
budget/ (keys and spend), cache/ (the response cache), kube/ (discovery and wake on Kubernetes).
Imports kvpilot.contract and itself; nothing imports the gateway.
"""
