"""What measures and tests the library: `ds4-mlx bench` and its benchmarks, the tiny models and the
transformers oracle of the tests, and the scripted model. It imports the library; the library never
imports it."""
