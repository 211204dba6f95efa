"""The core every part reads: the configuration (params.yaml's models), the out-root's layout, the stage registry, atomic artifacts, model and calibration-data loading, hub access and secrets."""
