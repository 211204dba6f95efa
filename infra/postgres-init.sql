-- Runs once, when the PostgreSQL volume of infra/compose.yaml is first initialised:
-- POSTGRES_DB creates Prefect's database, this creates MLflow's.
CREATE DATABASE mlflow;
