"""The request and its plan: what is evaluated (config, rules, keys), on what (datasets, checkpoint,
fingerprint) and how it is cut into shards (plan, gpus)."""
