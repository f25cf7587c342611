"""The GPU check: ``scripts/gpu_check.sh`` runs ``main.py``; see its docstring."""
