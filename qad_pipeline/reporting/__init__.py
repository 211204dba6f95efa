"""The run's report: the summary every report is made from (console, Prefect, MLflow), and its plots."""
