"""The tokens of the guarded registry of tests/service/http (a worker's and a reader's)."""

READER_TOKEN = "reader-token-0123456789"
WORKER_TOKEN = "worker-token-0123456789"
