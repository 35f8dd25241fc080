import boto3


def test_redis_and_s3_are_real(redis_client, s3_env):
    redis_client.xadd("s", {"a": "1"})
    assert redis_client.xlen("s") == 1
    s3 = boto3.client("s3", endpoint_url=s3_env)
    s3.create_bucket(Bucket="rlfleet-test")
    s3.put_object(Bucket="rlfleet-test", Key="k", Body=b"x")
    assert s3.get_object(Bucket="rlfleet-test", Key="k")["Body"].read() == b"x"
