"""Data sources, partitioners and on-device augmentation."""
from fedjax_ssl.data.partition import build_fed_data, carve_public  # noqa: F401
from fedjax_ssl.data.sources import load_dataset  # noqa: F401
from fedjax_ssl.data.types import Dataset, FedData  # noqa: F401
