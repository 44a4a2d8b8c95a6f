"""Functions the workers import by module path (torch-free unless named so)."""
