# The MLflow tracking server of infra/compose.yaml: MLflow with the PostgreSQL driver (backend
# store) and boto3 (artifacts on MinIO / S3). The server proxies artifact uploads, so the
# pipeline's pods need only MLFLOW_TRACKING_URI, no object-store credentials.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# Keep equal to MLFLOW_VERSION in infra/Dockerfile: the server must not be older than its clients.
ARG MLFLOW_VERSION=3.17.2

RUN pip install --no-cache-dir --disable-pip-version-check \
      "mlflow==${MLFLOW_VERSION}" psycopg2-binary boto3 \
 && useradd --uid 10001 --create-home mlflow

USER mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
