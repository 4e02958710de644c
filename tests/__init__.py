"""The test suites (one folder per package and Keras family) and their shared helpers (`tests.helpers`)."""
