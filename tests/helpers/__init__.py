"""What the tests share, in one place. A test module takes shared code from here and fixtures from
its conftest, never from another test module (tests/integration/test_layout.py checks it): a test
module is free to change without breaking a tier it does not belong to."""
