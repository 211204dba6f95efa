"""Prefect flows that wire the stages in tasks/ into the qad-pipeline DAG."""
