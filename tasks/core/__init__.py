"""What every stage and engine builds on: the config, the store and where artifacts live in it, rollout
records, data, models, tracking, the run lease, errors, processes and local paths. Imports nothing from the
rest of `tasks`."""
