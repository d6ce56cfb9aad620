import os
import sys

# Interpreter mode for Triton kernels on CPU; must be set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
