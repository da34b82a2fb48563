"""Example run configs, installed as `agentrl.examples` (package data): `agentrl examples` lists them."""
