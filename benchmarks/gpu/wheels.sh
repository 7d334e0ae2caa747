#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12, torch and transformers but none of our other
# dependencies and no network: run here (where pip reaches a registry), then carry .whl/ to that
# machine; gpu_run.sh installs them into /tmp/site when hivemind is missing there. Versions are the
# ones CI resolves today; the three that publish no wheel are built here (pure Python).
set -eu
dest=${1:-.whl}
mkdir -p "$dest"
platforms="--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
binary="hivemind==1.1.12 multiaddr==0.2.0 py-cid==0.5.0 py-multihash==3.0.0 py-multibase==2.0.0
        py-multicodec==1.0.0 morphys==1.0 base58==2.1.1 netaddr==1.3.0 configargparse==1.9.0
        cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 grpcio-tools==1.85.1 grpcio==1.85.3
        protobuf==7.36.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 dnspython==2.9.2 trio==0.35.0 trio-typing==0.10.0 blake3==1.0.11
        mmh3==5.3.1 outcome==1.3.0.post0 sniffio==1.3.1 async-generator==1.10 importlib-metadata==10.2.0
        lazy-importer==0.1.0 typing-extensions"
for spec in $binary; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms -d "$dest" "$spec"
done
python3 -m pip wheel -q --no-deps -w "$dest" varint==1.0.2 prefetch-generator==1.0.3 python-baseconv==1.2.2
ls "$dest" | wc -l
