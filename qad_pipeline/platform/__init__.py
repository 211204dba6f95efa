"""The platform the stages run on: DVC versioning and remotes, Prefect's set-up, stage processes, run locks."""
