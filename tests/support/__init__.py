"""The tests' support code: servers they start on 127.0.0.1 (postgres.py: PostgreSQL and `mlflow
server`). Imported as `tests.support.<module>` (tests/conftest.py puts the repository root on
sys.path); nothing outside tests/ imports it."""
