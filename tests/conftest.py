import os

# Tests run on the CPU with gloo; kernels build into a throw-away cache shared by the session.
os.environ.setdefault("HYBRID_KERNELS_CACHE", os.path.join(os.path.dirname(__file__), "..", "build", "kernels-test-cache"))
