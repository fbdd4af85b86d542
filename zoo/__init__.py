"""zoo: a Flax (Linen) model zoo with config-driven, sharded experiments."""
