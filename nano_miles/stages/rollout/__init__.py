"""The rollout producer: dataset prompts -> engine -> RolloutGroups, under the version gate
(`producer.py`), with the ledger of issued groups (`ledger.py`)."""
