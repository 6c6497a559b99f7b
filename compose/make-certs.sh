#!/usr/bin/env bash
# Generate the secrets the compose deployment needs, with openssl, into compose/secrets/ (git-ignored):
#
#   ca.crt, ca.key         a private CA (ca.key never leaves this directory; ca.crt is the kafka_ca secret that
#                          the streamrec services verify the broker with: STREAMREC_KAFKA_SSL_CA_LOCATION)
#   broker/                mounted read-only on the broker at /etc/kafka/secrets:
#     kafka.keystore.p12   the broker's key and certificate (CN and subjectAltName "kafka", the name clients
#                          connect to, plus "localhost"), signed by the CA, in a PKCS12 keystore
#     keystore_creds       the keystore password (key_creds: the same; PKCS12 needs key = store password)
#     kafka_server_jaas.conf   the SCRAM login module for the SASL_SSL listener (holds no secret)
#   kafka_password         the SCRAM-SHA-512 password of the streamrec Kafka user (the kafka_password secret;
#                          the `topics` init service creates the user with it)
#   redis_password         the Redis password (the redis_password secret: redis-server's requirepass, and
#                          STREAMREC_REDIS_PASSWORD_FILE of every streamrec service)
#
# Usage (from anywhere):
#   compose/make-certs.sh            create what is missing; existing files are kept (safe to re-run)
#   compose/make-certs.sh --force    regenerate everything: new CA, broker certificate, Kafka and Redis passwords
#                                    (then recreate every container: docker compose ... up -d --force-recreate)
# Environment: CERT_DAYS (validity, default 825), KAFKA_HOSTNAME (broker name in the certificate, default kafka).
#
# Permissions: compose/secrets/ is 0700 (other host users cannot read anything in it); the files the
# containers read are 0644 inside it, because the containers run as other users (kafka: uid 1000,
# streamrec: uid 10001) and docker bind-mounts them as they are. ca.key stays 0600.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/secrets"
days="${CERT_DAYS:-825}"
host="${KAFKA_HOSTNAME:-kafka}"
force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; exit 0 ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }

umask 077
mkdir -p "$out/broker"
chmod 700 "$out"
chmod 755 "$out/broker"
if [[ $force == 1 ]]; then
  rm -f "$out/ca.crt" "$out/ca.key" "$out/ca.srl" "$out/kafka_password" "$out/redis_password" "$out/broker/"*
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

secret() { openssl rand -hex 32 | tr -d '\n'; }

new_ca=0
if [[ ! -s $out/ca.crt || ! -s $out/ca.key ]]; then
  openssl req -x509 -new -newkey rsa:3072 -sha256 -nodes -days "$days" \
    -subj "/CN=streamrec compose CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
  chmod 600 "$out/ca.key"
  chmod 644 "$out/ca.crt"
  new_ca=1
  echo "make-certs.sh: new CA $out/ca.crt"
fi

if [[ $new_ca == 1 || ! -s $out/broker/kafka.keystore.p12 || ! -s $out/broker/keystore_creds ]]; then
  openssl req -new -newkey rsa:3072 -sha256 -nodes -subj "/CN=$host" \
    -keyout "$work/broker.key" -out "$work/broker.csr" 2>/dev/null
  cat > "$work/ext.cnf" <<EXT
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:$host, DNS:localhost
EXT
  openssl x509 -req -sha256 -days "$days" -in "$work/broker.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAserial "$out/ca.srl" -CAcreateserial -extfile "$work/ext.cnf" -out "$work/broker.crt" 2>/dev/null
  openssl verify -CAfile "$out/ca.crt" "$work/broker.crt" >/dev/null
  secret > "$out/broker/keystore_creds"
  cp "$out/broker/keystore_creds" "$out/broker/key_creds"
  openssl pkcs12 -export -name kafka -inkey "$work/broker.key" -in "$work/broker.crt" -certfile "$out/ca.crt" \
    -passout "file:$out/broker/keystore_creds" -out "$out/broker/kafka.keystore.p12"
  cp "$work/broker.crt" "$out/broker/kafka.crt"  # for inspection: openssl x509 -in ... -noout -text
  echo "make-certs.sh: new broker certificate for $host (valid $days days) in $out/broker/kafka.keystore.p12"
fi

cat > "$out/broker/kafka_server_jaas.conf" <<'JAAS'
KafkaServer {
  org.apache.kafka.common.security.scram.ScramLoginModule required;
};
JAAS

if [[ ! -s $out/kafka_password ]]; then
  secret > "$out/kafka_password"
  echo "make-certs.sh: new Kafka SASL password in $out/kafka_password"
fi

if [[ ! -s $out/redis_password ]]; then
  secret > "$out/redis_password"
  echo "make-certs.sh: new Redis password in $out/redis_password"
fi

chmod 644 "$out/broker/"* "$out/kafka_password" "$out/redis_password" "$out/ca.crt"
echo "make-certs.sh: secrets ready in $out"
